(* F7 (c) (THEORY.md §2; proofs/F7 (c)): dividing by the group's reward std biases the estimator, not only by a
   scalar factor.  The counterexample of proofs/F7: one prompt, one token (L = 1) from V = {0, 1, 2} with no stop
   token, the uniform policy, score e_v - pi in R^3, rewards R = (0, 1, 10), groups of N = 2; the std is any
   sigma >= 0 with sigma^2 = sum_j (R_j - Rbar)^2 / k, k > 0 (k = 1: GRPO's unbiased std; k = 2: the population
   std, rational here).  Then E_2[A_0 S_0] is not a multiple of E[R S] = E g_0. *)
From mathcomp Require Import all_ssreflect all_algebra.
From OTB Require Import Defs Lemmas L0 F1 F7.

Set Implicit Arguments.
Unset Strict Implicit.
Unset Printing Implicit Defensive.

Import GRing.Theory Num.Theory Order.TTheory.
Local Open Scope ring_scope.

Section Counterexample.
Variable R : realFieldType.

Definition cx_stop : pred 'I_3 := xpred0.
Definition cx_rho (_ : unit) : R := 1.
Definition cx_pi (_ : unit) (_ : seq (option 'I_3)) (_ : 'I_3) : R := 3%:R^-1.
Definition cx_score (_ : unit) (_ : seq (option 'I_3)) (v : 'I_3) : 'rV[R]_3 := \row_k ((k == v)%:R - 3%:R^-1).
Definition cx_r (v : 'I_3) : R := (nth 0%N [:: 0; 1; 10]%N v)%:R.
Definition cx_R (w : Omega [finType of unit] [finType of 'I_3] 1) : R := if tok 0 w is Some v then cx_r v else 0.

Local Notation Omega := (Omega [finType of unit] [finType of 'I_3] 1).
Local Notation Pr := (@Pr R [finType of unit] [finType of 'I_3] 1 cx_stop cx_rho cx_pi).
Local Notation S := (@S R [finType of unit] [finType of 'I_3] 1 3 cx_stop cx_score).
Local Notation PN := (@group_law R [finType of unit] [finType of 'I_3] 1 cx_stop cx_rho cx_pi 2).

Lemma three_neq0 : (3%:R : R) != 0. Proof. by rewrite pnatr_eq0. Qed.

(* The instance satisfies the hypotheses of the setting. *)
Lemma cx_prompt_law : prompt_law cx_rho.
Proof. by split=> [x|]; rewrite /cx_rho ?ler01 // (big_pred1 tt) // => -[]. Qed.

Lemma cx_policy : policy cx_stop cx_pi.
Proof.
move=> x h _; split=> [v|]; first by rewrite /cx_pi invr_ge0 ler0n.
by rewrite /cx_pi sumr_const card_ord -[_ *+ 3]mulr_natl mulfV // three_neq0.
Qed.

(* sum_v F v (e_k - pi)_v = F k - (1/3) sum_v F v. *)
Lemma sum_centred (F : 'I_3 -> R) k : \sum_v F v * ((k == v)%:R - 3%:R^-1) = F k - 3%:R^-1 * \sum_v F v.
Proof.
rewrite (eq_bigr (fun v => (v == k)%:R * F v - 3%:R^-1 * F v)) => [|v _]; last first.
  by rewrite mulrBr eq_sym mulrC [F v * _]mulrC.
rewrite sumrB -mulr_sumr (bigD1 k) //= eqxx mul1r big1 ?addr0 // => v /negPf ->.
by rewrite mul0r.
Qed.

Lemma cx_zero_mean : zero_mean_score cx_stop cx_pi cx_score.
Proof.
move=> x h _; apply/rowP => k; rewrite summxE mxE.
rewrite (eq_bigr (fun v => 3%:R^-1 * ((k == v)%:R - 3%:R^-1))) => [|v _]; last by rewrite !mxE.
rewrite sum_centred sumr_const card_ord -(mulr_natr (3%:R^-1) 3) mulVf ?three_neq0 //.
by rewrite mulr1 subrr.
Qed.

(* The response that is the single token v. *)
Definition wv (v : 'I_3) : Omega := (tt, [tuple of Some v :: [tuple]]).

Lemma cx_sum (f : Omega -> R) : \sum_w Pr w * f w = \sum_v 3%:R^-1 * f (wv v).
Proof.
have := Er_Pr cx_stop cx_rho cx_pi f; rewrite /Er => ->.
rewrite (big_pred1 tt); last by case.
rewrite /cx_rho mul1r sum_tuple_cons sum_option /=.
rewrite (eq_bigr (fun _ => 0)) => [|y _]; last first.
  by rewrite law_from_cons /q /= !mul0r.
rewrite big1 // add0r; apply: eq_bigr => v _; rewrite sum_tuple0 law_from_cons /q /=.
by rewrite /Defs.law_from big_ord0 mulr1.
Qed.

Lemma two_neq0 : (2%:R : R) != 0. Proof. by rewrite pnatr_eq0. Qed.
Lemma half_diff (a b : R) : a - (a + b) / 2%:R = (a - b) / 2%:R.
Proof.
apply: (mulIf two_neq0); rewrite mulrBl !divfK ?two_neq0 //.
by rewrite mulr_natr mulr2n opprD addrA addrK.
Qed.
Lemma sq_dev2 (a b : R) : (a - (a + b) / 2%:R) ^+ 2 + (b - (a + b) / 2%:R) ^+ 2 = (a - b) ^+ 2 / 2%:R.
Proof.
rewrite half_diff [a + b]addrC half_diff -(opprB a b) mulNr sqrrN -mulr2n -mulr_natr.
by rewrite expr_div_n [2%:R ^+ 2]expr2 invfM -!mulrA mulVf ?two_neq0 // mulr1.
Qed.
Lemma div_norm (x : R) : x / `|x| = Num.sg x.
Proof.
have [->|x0] := eqVneq x 0; first by rewrite mul0r sgr0.
by rewrite -{1}(mulr_sg_norm x) mulfK // normr_eq0.
Qed.
Lemma sg_natB (m n : nat) : Num.sg (m%:R - n%:R : R) = if (m < n)%N then -1 else if (n < m)%N then 1 else 0.
Proof.
case: ltnP => [mn|nm]; first by rewrite ltr0_sg // subr_lt0 ltr_nat.
case: ltnP => [nm'|mn]; first by rewrite gtr0_sg // subr_gt0 ltr_nat.
have -> : m = n by apply/eqP; rewrite eqn_leq nm mn.
by rewrite subrr sgr0.
Qed.

Definition pair2 (w1 w2 : Omega) : {ffun 'I_2 -> Omega} := [ffun j => if j == ord0 then w1 else w2].

(* A group of two: E_2[F] = sum_w1 P(w1) sum_w2 P(w2) F(w1, w2). *)
Lemma cx_group_sum (F : {ffun 'I_2 -> Omega} -> R) :
  \sum_Y PN Y * F Y = \sum_w1 Pr w1 * \sum_w2 Pr w2 * F (pair2 w1 w2).
Proof.
under [RHS]eq_bigr do rewrite mulr_sumr.
rewrite pair_big /= (reindex (fun p : Omega * Omega => pair2 p.1 p.2)) /=.
  apply: eq_bigr => -[w1 w2] _ /=.
  by rewrite /group_law !big_ord_recl big_ord0 !ffunE /= mulr1 mulrA.
exists (fun Y => (Y ord0, Y ord_max)) => [[w1 w2] _|Y _] /=; first by rewrite !ffunE.
apply/ffunP => -[[|[|m]] p] //=; rewrite ffunE /=; congr (Y _); exact: val_inj.
Qed.

Lemma S_wv v : S (wv v) = cx_score tt [::] v.
Proof. by rewrite /Defs.S big_ord1 /s_tok. Qed.

Lemma R_wv v : cx_R (wv v) = cx_r v.
Proof. by []. Qed.

Section Std.
Variables (k : R) (sigma : {ffun 'I_2 -> Omega} -> R).
Hypothesis k0 : 0 < k.
Hypothesis Hsigma : forall Y, 0 <= sigma Y /\ sigma Y ^+ 2 = sq_dev cx_R Y / k.

Let o0 : 'I_3 := ord0.
Let o1 : 'I_3 := Ordinal (isT : (1 < 3)%N).
Let s01 := sigma (pair2 (wv o0) (wv o1)).

Lemma mean_pair2 w1 w2 : mean_all cx_R (pair2 w1 w2) = (cx_R w1 + cx_R w2) / 2%:R.
Proof. by rewrite /mean_all !big_ord_recl big_ord0 !ffunE /= addr0. Qed.

Lemma sigma_sq w1 w2 : sigma (pair2 w1 w2) ^+ 2 = (cx_R w1 - cx_R w2) ^+ 2 / 2%:R / k.
Proof.
have [_ ->] := Hsigma (pair2 w1 w2); rewrite /sq_dev mean_pair2 !big_ord_recl big_ord0 !ffunE /= addr0.
by rewrite sq_dev2.
Qed.

Lemma s01_sq : s01 ^+ 2 = 2%:R^-1 / k.
Proof. by rewrite /s01 sigma_sq !R_wv /cx_r /= mulr0n mulr1n sub0r sqrrN expr1n mul1r. Qed.

Lemma s01_neq0 : s01 != 0.
Proof.
apply/eqP => s0; have := s01_sq; rewrite s0 expr0n /= => /esym/eqP.
by rewrite mulf_eq0 !invr_eq0 (negPf two_neq0) (gt_eqF k0).
Qed.

(* sigma of any pair is |R_1 - R_2| times sigma of the pair (0, 1): the square roots agree. *)
Lemma sigma_pair2 w1 w2 : sigma (pair2 w1 w2) = `|cx_R w1 - cx_R w2| * s01.
Proof.
have [ge0 _] := Hsigma (pair2 w1 w2); have [ge1 _] := Hsigma (pair2 (wv o0) (wv o1)).
apply/eqP; rewrite -(@eqr_expn2 _ 2) // ?mulr_ge0 //.
by rewrite sigma_sq exprMn s01_sq real_normK ?num_real // mulrA.
Qed.

(* The std-scaled advantage of member 0 is sg(R_0 - R_1) m0, with m0 = 1 / (2 sigma(0, 1)). *)
Lemma advantage_pair2 w1 w2 :
  (cx_R w1 - mean_all cx_R (pair2 w1 w2)) / sigma (pair2 w1 w2) = Num.sg (cx_R w1 - cx_R w2) / (2%:R * s01).
Proof.
rewrite mean_pair2 half_diff sigma_pair2 -div_norm !invfM -!mulrA; congr (_ * _).
by rewrite mulrCA.
Qed.

Let m0 := (2%:R * s01)^-1.

Lemma m0_neq0 : m0 != 0.
Proof. by rewrite invr_eq0 mulf_neq0 ?two_neq0 ?s01_neq0. Qed.

(* u(v) = sum_v' sg(r_v - r_v'): u(0) = -2, u(1) = 0, and sum_v u(v) = 0 (antisymmetry). *)
Let u (v1 : 'I_3) := \sum_v2 Num.sg (cx_r v1 - cx_r v2).

Lemma sum_u : \sum_v u v = 0.
Proof.
have E : \sum_v1 \sum_v2 Num.sg (cx_r v1 - cx_r v2) = - \sum_v1 \sum_v2 Num.sg (cx_r v1 - cx_r v2).
  transitivity (\sum_v1 \sum_v2 Num.sg (cx_r v2 - cx_r v1)); first exact: exchange_big.
  rewrite -sumrN; apply: eq_bigr => v1 _; rewrite -sumrN; apply: eq_bigr => v2 _.
  by rewrite -sgrN opprB.
rewrite /u; move: E; set x := \sum_v1 _ => E.
have : x *+ 2 == 0 by rewrite mulr2n {2}E subrr.
by rewrite mulrn_eq0 => /eqP.
Qed.

Lemma u0 : u o0 = - (1 + 1).
Proof. by rewrite /u !big_ord_recl big_ord0 /cx_r /= !sg_natB /= add0r addr0 opprD. Qed.

Lemma u1 : u o1 = 0.
Proof. by rewrite /u !big_ord_recl big_ord0 /cx_r /= !sg_natB /= add0r addr0 subrr. Qed.

(* The components of E_2[A_0 S_0] and of E[R S]. *)
Lemma comp_ghat_std kk :
  Ev PN (ghat_seq_std cx_stop cx_score cx_R sigma ord0) 0 kk = 3%:R^-1 * (3%:R^-1 * m0) * u kk.
Proof.
rewrite Ev_comp /Er; under eq_bigr do rewrite /ghat_seq_std mxE.
rewrite cx_group_sum.
transitivity (\sum_w1 Pr w1 * \sum_v2 3%:R^-1 *
    ((cx_R w1 - mean_all cx_R (pair2 w1 (wv v2))) / sigma (pair2 w1 (wv v2)) * S w1 0 kk)).
  by apply: eq_bigr => w1 _; rewrite cx_sum; congr (_ * _); apply: eq_bigr => v2 _; rewrite ffunE.
rewrite cx_sum.
transitivity (\sum_v1 (3%:R^-1 * (3%:R^-1 * m0)) * (u v1 * ((kk == v1)%:R - 3%:R^-1))).
  apply: eq_bigr => v1 _; rewrite /u mulr_suml !mulr_sumr; apply: eq_bigr => v2 _.
  rewrite advantage_pair2 S_wv !R_wv mxE -/m0.
  by rewrite -!mulrA; congr (_ * (_ * _)); rewrite mulrCA.
by rewrite -mulr_sumr sum_centred sum_u mulr0 subr0.
Qed.

Lemma comp_ghat0 kk :
  Ev Pr (fun w => cx_R w *: S w) 0 kk = 3%:R^-1 * (cx_r kk - 3%:R^-1 * \sum_v cx_r v).
Proof.
rewrite Ev_comp /Er; under eq_bigr do rewrite mxE.
rewrite cx_sum -sum_centred mulr_sumr; apply: eq_bigr => v _.
by rewrite S_wv R_wv mxE.
Qed.

(* F7 (c): E_2[A_0 S_0] is not a multiple of E[R S] = E g_0: std scaling biases the estimator, and not by a
   positive factor. *)
Theorem F7_std_biases : forall c : R,
  Ev PN (ghat_seq_std cx_stop cx_score cx_R sigma ord0) != c *: Ev Pr (fun w => cx_R w *: S w).
Proof.
move=> c; apply/eqP => E.
have E1 := congr1 (fun M : 'rV[R]_3 => M 0 o1) E; have E0 := congr1 (fun M : 'rV[R]_3 => M 0 o0) E.
move: E1 E0; rewrite /= !mxE !comp_ghat_std !comp_ghat0 u1 u0 mulr0 => E1 E0.
have g1 : cx_r o1 - 3%:R^-1 * (\sum_v cx_r v) != 0.
  rewrite /cx_r !big_ord_recl big_ord0 /= addr0 -!natrD subr_eq0 lt_eqF //.
  by rewrite ltr_pdivl_mull ?ltr0n // mulr1 ltr_nat.
have c0 : c = 0.
  have : c * (3%:R^-1 * (cx_r o1 - 3%:R^-1 * (\sum_v cx_r v))) == 0 by rewrite -E1.
  by rewrite !mulf_eq0 invr_eq0 (negPf three_neq0) (negPf g1) !orbF => /eqP.
move/eqP: E0; rewrite c0 mul0r !mulf_eq0 !invr_eq0 mulf_eq0 (negPf three_neq0) (negPf two_neq0) (negPf s01_neq0) /=.
by rewrite oppr_eq0 paddr_eq0 ?ler01 // oner_eq0.
Qed.

End Std.


(* The hypothesis on sigma is satisfiable in every real field: the population std (divisor N = 2, k = 2) of this
   group is the rational |R_0 - R_1| / 2. *)
Corollary F7_population_std_biases : forall c : R,
  Ev PN (ghat_seq_std cx_stop cx_score cx_R (fun Y => `|cx_R (Y ord0) - cx_R (Y (lift ord0 ord0))| / 2%:R) ord0)
  != c *: Ev Pr (fun w => cx_R w *: S w).
Proof.
apply: (@F7_std_biases 2%:R) => [|Y]; first by rewrite ltr0n.
split; first by rewrite divr_ge0 ?ler0n.
rewrite /sq_dev /mean_all !big_ord_recl !big_ord0 /= !addr0 sq_dev2 expr_div_n real_normK ?num_real //.
by rewrite [2%:R ^+ 2]expr2 invfM mulrA.
Qed.

End Counterexample.

(* GRPO's std: the unbiased std (divisor N - 1 = 1), a square root, in any real closed field. *)
Section GRPO.
Variable R : rcfType.

Corollary F7_grpo_std_biases : forall c : R,
  Ev (@group_law R [finType of unit] [finType of 'I_3] 1 cx_stop (@cx_rho R) (@cx_pi R) 2)
     (ghat_seq_std cx_stop (@cx_score R) (@cx_R R) (fun Y => Num.sqrt (sq_dev (@cx_R R) Y / (2 - 1)%:R)) ord0)
  != c *: Ev (@Pr R [finType of unit] [finType of 'I_3] 1 cx_stop (@cx_rho R) (@cx_pi R))
            (fun w => @cx_R R w *: @S R [finType of unit] [finType of 'I_3] 1 3 cx_stop (@cx_score R) w).
Proof.
apply: (@F7_std_biases R 1%:R) => [|Y]; first by rewrite ltr0n.
split; first exact: sqrtr_ge0.
by rewrite sqr_sqrtr // divr_ge0 ?ler0n // sumr_ge0 // => j _; exact: sqr_ge0.
Qed.

End GRPO.
