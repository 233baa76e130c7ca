(* F2 (c) (THEORY.md §2; proofs/F2 (c)): orthogonality does not survive weighting by the outcome.  The
   counterexample of proofs/F2: one prompt, V = {a, b} (0 and 1, no stop token), L = 2, the uniform
   parameter-shared policy with the scalar score +1/2 for a and -1/2 for b, and R = 1{y_1 = y_2}.  Then
   E[m_1 m_2 <s_1, s_2>] = 0 (F2 (a)) but E[R m_1 m_2 <s_1, s_2>] > 0 (it is 1/8). *)
From mathcomp Require Import all_ssreflect all_algebra.
From OTB Require Import Defs Lemmas L0 F1 F2.

Set Implicit Arguments.
Unset Strict Implicit.
Unset Printing Implicit Defensive.

Import GRing.Theory Num.Theory Order.TTheory.
Local Open Scope ring_scope.

Section Counterexample.
Variable R : realFieldType.

Definition cy_stop : pred 'I_2 := xpred0.
Definition cy_rho (_ : unit) : R := 1.
Definition cy_pi (_ : unit) (_ : seq (option 'I_2)) (_ : 'I_2) : R := 2%:R^-1.
Definition cy_s (v : 'I_2) : R := if v == ord0 then 2%:R^-1 else - 2%:R^-1.
Definition cy_score (_ : unit) (_ : seq (option 'I_2)) (v : 'I_2) : 'rV[R]_1 := \row_k cy_s v.
Definition cy_R (w : Omega [finType of unit] [finType of 'I_2] 2) : R := (tok 0 w == tok 1 w)%:R.

Local Notation Omega := (Omega [finType of unit] [finType of 'I_2] 2).
Local Notation Pr := (@Pr R [finType of unit] [finType of 'I_2] 2 cy_stop cy_rho cy_pi).
Local Notation mask := (@mask R [finType of unit] [finType of 'I_2] 2 cy_stop).
Local Notation s_tok := (@s_tok R [finType of unit] [finType of 'I_2] 2 1 cy_stop cy_score).

Lemma two_neq0 : (2%:R : R) != 0. Proof. by rewrite pnatr_eq0. Qed.

Lemma cy_prompt_law : prompt_law cy_rho.
Proof. by split=> [x|]; rewrite /cy_rho ?ler01 // (big_pred1 tt) // => -[]. Qed.

Lemma cy_policy : policy cy_stop cy_pi.
Proof.
move=> x h _; split=> [v|]; first by rewrite /cy_pi invr_ge0 ler0n.
by rewrite /cy_pi sumr_const card_ord -(mulr_natr (2%:R^-1) 2) mulVf // two_neq0.
Qed.

Lemma cy_zero_mean : zero_mean_score cy_stop cy_pi cy_score.
Proof.
move=> x h _; apply/rowP => k; rewrite summxE !big_ord_recl big_ord0 !mxE /cy_s /= addr0.
by rewrite /cy_pi mulrN subrr.
Qed.

(* The response (v1, v2). *)
Definition wy (v1 v2 : 'I_2) : Omega := (tt, [tuple of Some v1 :: [tuple of Some v2 :: [tuple]]]).

Lemma cy_sum (f : Omega -> R) : \sum_w Pr w * f w = \sum_v1 \sum_v2 2%:R^-1 * (2%:R^-1 * f (wy v1 v2)).
Proof.
have := Er_Pr cy_stop cy_rho cy_pi f; rewrite /Er => ->.
rewrite (big_pred1 tt); last by case.
rewrite /cy_rho mul1r sum_tuple_cons sum_option /=.
rewrite big1 => [|y _]; last by rewrite law_from_cons /q /= !mul0r.
rewrite add0r; apply: eq_bigr => v1 _; rewrite sum_tuple_cons sum_option /=.
rewrite big1 => [|y _]; last by rewrite !law_from_cons /q /= mul0r mulr0 mul0r.
rewrite add0r; apply: eq_bigr => v2 _; rewrite sum_tuple0 !law_from_cons /q /=.
by rewrite /Defs.law_from big_ord0 mulr1 -mulrA.
Qed.

Lemma psum2_gt0 (F : 'I_2 -> R) i : (forall j, 0 <= F j) -> 0 < F i -> 0 < \sum_j F j.
Proof.
move=> F0 Fi; rewrite (bigD1 i) //=.
by rewrite ltr_paddr // sumr_ge0.
Qed.

Lemma term_ge0 v1 v2 :
  0 <= cy_R (wy v1 v2) * (mask 0 (wy v1 v2) * mask 1 (wy v1 v2) * dot (s_tok 0 (wy v1 v2)) (s_tok 1 (wy v1 v2))).
Proof.
rewrite /cy_R /dot /Defs.mask /s_tok /= big_ord1 !mxE.
have [->|ne] := eqVneq v1 v2; first by rewrite /tok /= eqxx mulr1n !mul1r -expr2 sqr_ge0.
by rewrite /tok /= (inj_eq (@Some_inj _)) (negPf ne) mul0r.
Qed.

Lemma half_term_ge0 v1 v2 : 0 <= 2%:R^-1 * (2%:R^-1 *
  (cy_R (wy v1 v2) * (mask 0 (wy v1 v2) * mask 1 (wy v1 v2) * dot (s_tok 0 (wy v1 v2)) (s_tok 1 (wy v1 v2))))).
Proof.
have h : (0 : R) <= 2%:R^-1 by rewrite invr_ge0 ler0n.
by apply: mulr_ge0 => //; apply: mulr_ge0 => //; exact: term_ge0.
Qed.

(* F2 (c): unweighted, the cross term has mean 0 (F2 (a)); weighted by R it does not. *)
Theorem F2_fails_weighted_by_outcome :
  Er Pr (fun w => mask 0 w * mask 1 w * dot (s_tok 0 w) (s_tok 1 w)) = 0 /\
  0 < Er Pr (fun w => cy_R w * (mask 0 w * mask 1 w * dot (s_tok 0 w) (s_tok 1 w))).
Proof.
split; first exact: (F2_orthogonality 2 cy_rho cy_policy cy_zero_mean (j := 0) (t := 1)).
rewrite /Er cy_sum; apply: (@psum2_gt0 _ ord0) => [v1|].
  by apply: sumr_ge0 => v2 _; rewrite half_term_ge0.
apply: (@psum2_gt0 _ ord0) => [v2|]; first exact: half_term_ge0.
rewrite /cy_R /tok /dot /Defs.mask /s_tok /= big_ord1 !mxE !mul1r /cy_s /=.
by rewrite !mulr_gt0 ?invr_gt0 ?ltr0n.
Qed.

End Counterexample.
