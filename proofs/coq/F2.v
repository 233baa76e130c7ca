(* F2 (THEORY.md §2; proofs/F2): martingale orthogonality of the token scores, E[m_j m_t <s_j, s_t>] = 0 for
   j <> t, hence E||S_t||^2 = sum_(j <= t) E[m_j ||s_j||^2]. *)
From mathcomp Require Import all_ssreflect all_algebra.
From OTB Require Import Defs Lemmas L0 F1.

Set Implicit Arguments.
Unset Strict Implicit.
Unset Printing Implicit Defensive.

Import GRing.Theory Num.Theory Order.TTheory.
Local Open Scope ring_scope.

Section F2.
Variables (R : realFieldType) (X V : finType) (L d : nat).
Variable stop : pred V.
Variable rho : X -> R.
Variable pi : X -> seq (option V) -> V -> R.
Variable score : X -> seq (option V) -> V -> 'rV[R]_d.

Local Notation alive := (alive stop).
Local Notation Pr := (@Pr R X V L stop rho pi).
Local Notation Omega := (Omega X V L).
Local Notation mask := (@mask R X V L stop).
Local Notation s_tok := (@s_tok R X V L d stop score).
Local Notation S := (@S R X V L d stop score).
Local Notation S_upto := (@S_upto R X V L d stop score).

(* E <F(h_t), s_t> = 0 for every vector function F of the prefix. *)
Lemma prefix_orth : policy stop pi -> zero_mean_score stop pi score ->
  forall t (F : X -> seq (option V) -> 'rV[R]_d), Er Pr (fun w => dot (F w.1 (hist t w)) (s_tok t w)) = 0.
Proof.
move=> Hpi Hs t F; rewrite (Er_ext Pr (g := fun w => \sum_(k < d) F w.1 (hist t w) 0 k * s_tok t w 0 k)) //.
rewrite Er_sum big1 // => k _.
have := prefix_mean L rho Hpi Hs t (fun x h => F x h 0 k) => /(congr1 (fun M : 'rV[R]_d => M 0 k)).
by rewrite Ev_comp mxE => <-; apply: Er_ext => w; rewrite mxE.
Qed.

(* s_j read from a longer prefix. *)
Definition s_at (x : X) (h : seq (option V)) (j : nat) : 'rV[R]_d :=
  if alive (take j h) then (if nth None h j is Some v then score x (take j h) v else 0) else 0.

Lemma s_tok_at j t (w : Omega) : (j < t)%N -> s_tok j w = s_at w.1 (hist t w) j.
Proof.
move=> lt; rewrite /Defs.s_tok /s_at /hist /tok take_take ?(ltnW lt) //.
by rewrite nth_take.
Qed.

Lemma F2_lt : policy stop pi -> zero_mean_score stop pi score ->
  forall j t, (j < t)%N -> Er Pr (fun w => mask j w * mask t w * dot (s_tok j w) (s_tok t w)) = 0.
Proof.
move=> Hpi Hs j t lt.
rewrite -(prefix_orth Hpi Hs t (fun x h => ((alive (take j h))%:R * (alive h)%:R) *: s_at x h j)).
apply: Er_ext => w; rewrite dotZl -s_tok_at //.
by rewrite /Defs.mask /hist take_take ?(ltnW lt).
Qed.

(* F2(a). *)
Theorem F2_orthogonality : policy stop pi -> zero_mean_score stop pi score ->
  forall j t, j <> t -> Er Pr (fun w => mask j w * mask t w * dot (s_tok j w) (s_tok t w)) = 0.
Proof.
move=> Hpi Hs j t /eqP; rewrite neq_ltn => /orP[lt|lt]; first exact: F2_lt.
rewrite -(F2_lt Hpi Hs lt); apply: Er_ext => w.
by rewrite dotC [mask t w * _]mulrC.
Qed.

Lemma dot_s_tok_mask j t (w : Omega) : dot (s_tok j w) (s_tok t w) = mask j w * mask t w * dot (s_tok j w) (s_tok t w).
Proof. by rewrite -mulrA -dotZr s_tok_mask -dotZl s_tok_mask. Qed.

(* F2(b): E||S_t||^2 = sum_(j <= t) E[m_j ||s_j||^2]. *)
Theorem F2_energy : policy stop pi -> zero_mean_score stop pi score ->
  forall t, Er Pr (fun w => sqnorm (S_upto t w)) =
            \sum_(j < L | (j <= t)%N) Er Pr (fun w => mask j w * sqnorm (s_tok j w)).
Proof.
move=> Hpi Hs t.
rewrite (Er_ext Pr (g := fun w => \sum_(j < L | (j <= t)%N) \sum_(k < L | (k <= t)%N)
                                  dot (s_tok j w) (s_tok k w))); last first.
  by move=> w; rewrite /sqnorm /S_upto dot_suml; apply: eq_bigr => j _; rewrite dot_sumr.
rewrite Er_sum; apply: eq_bigr => j jt; rewrite Er_sum (bigD1 j) //= big1 ?addr0.
  by apply: Er_ext => w; rewrite /sqnorm -{1}s_tok_mask dotZl.
move=> k /andP[_ kj]; rewrite -(F2_orthogonality Hpi Hs (j := j) (t := k)); last first.
  by move=> /val_inj jk; rewrite jk eqxx in kj.
by apply: Er_ext => w; rewrite -dot_s_tok_mask.
Qed.

Corollary F2_energy_S : policy stop pi -> zero_mean_score stop pi score ->
  Er Pr (fun w => sqnorm (S w)) = \sum_(j < L) Er Pr (fun w => mask j w * sqnorm (s_tok j w)).
Proof.
move=> Hpi Hs; rewrite (Er_ext Pr (g := fun w => sqnorm (S_upto L w))); last first.
  by move=> w; rewrite /S_upto /Defs.S; congr sqnorm; apply: eq_bigl => j; rewrite ltnW.
by rewrite F2_energy //; apply: eq_bigl => j; rewrite ltnW.
Qed.

End F2.
