(* F7 (THEORY.md §2; proofs/F7): group estimators.  N responses drawn independently, P_N(Y) = prod_i P(Y_i).
   (a) A baseline of member i that reads only the other members (and member i's own prefix) keeps member i's
       estimator exactly unbiased: any function of the others, so THEORY §3's weighted leave-one-out means for every
       energy W and every eps (token and sequence level).
   (b) Include-self plain mean = (N - 1)/N x leave-one-out, identically, hence in expectation.
   (d) A group of one: the leave-one-out baseline is 0 and the estimator is REINFORCE.
   (c), std scaling biases, is in F7_std.v. *)
From mathcomp Require Import all_ssreflect all_algebra.
From OTB Require Import Defs Lemmas L0 F1.

Set Implicit Arguments.
Unset Strict Implicit.
Unset Printing Implicit Defensive.

Import GRing.Theory Num.Theory Order.TTheory.
Local Open Scope ring_scope.

Section GroupSums.
Variables (R : realFieldType) (T : finType) (N : nat).
Implicit Types (Y : {ffun 'I_N -> T}) (i j : 'I_N) (w : T).

Definition upd Y i w : {ffun 'I_N -> T} := [ffun j => if j == i then w else Y j].

Lemma upd_at Y i w : upd Y i w i = w.
Proof. by rewrite ffunE eqxx. Qed.

Lemma upd_off Y i w j : j != i -> upd Y i w j = Y j.
Proof. by rewrite ffunE => /negPf ->. Qed.

Lemma upd_upd Y i w w' : upd (upd Y i w) i w' = upd Y i w'.
Proof. by apply/ffunP => j; rewrite !ffunE; case: (j == i). Qed.

Lemma upd_id Y i : upd Y i (Y i) = Y.
Proof. by apply/ffunP => j; rewrite ffunE; case: eqP => [->|]. Qed.

Lemma upd_eq Y i w : (upd Y i w == Y) = (Y i == w).
Proof.
apply/eqP/eqP => [<-|<-]; first by rewrite upd_at.
exact: upd_id.
Qed.

(* Summing over groups: member i's draw w ranges over T, the others over their values (Y i fixed at w0). *)
Lemma sum_group_split i w0 (H : {ffun 'I_N -> T} -> R) :
  \sum_(Y : {ffun 'I_N -> T}) H Y = \sum_(Y : {ffun 'I_N -> T} | Y i == w0) \sum_w H (upd Y i w).
Proof.
rewrite (partition_big (fun Y : {ffun 'I_N -> T} => Y i) xpredT) //= exchange_big /=; apply: eq_bigr => w _.
rewrite (reindex_onto (fun Y : {ffun 'I_N -> T} => upd Y i w) (fun Y => upd Y i w0)) => [|Y /eqP Yw]; last first.
  by rewrite upd_upd -Yw upd_id.
by apply: eq_bigl => Y; rewrite upd_at eqxx upd_upd upd_eq.
Qed.

Variable P : T -> R.

Lemma prod_upd Y i w : \prod_j P (upd Y i w j) = P w * \prod_(j | j != i) P (Y j).
Proof.
rewrite (bigD1 i) //= upd_at; congr (_ * _); apply: eq_bigr => j ji.
by rewrite upd_off.
Qed.

(* Independence: for F that reads member i's draw and the others, E_N[F(Y_i, Y)] = sum over the others of their
   probability times E[F(., Y)] in member i's draw. *)
Lemma group_decomp i w0 (F : T -> {ffun 'I_N -> T} -> R) :
  (forall w Y Y', (forall j, j != i -> Y j = Y' j) -> F w Y = F w Y') ->
  \sum_(Y : {ffun 'I_N -> T}) (\prod_j P (Y j)) * F (Y i) Y =
  \sum_(Y : {ffun 'I_N -> T} | Y i == w0) (\prod_(j | j != i) P (Y j)) * \sum_w P w * F w Y.
Proof.
move=> Finv; rewrite (@sum_group_split i w0); apply: eq_bigr => Y _.
rewrite mulr_sumr; apply: eq_bigr => w _; rewrite prod_upd upd_at mulrCA mulrA.
by rewrite (Finv w (upd Y i w) Y) // => j ji; rewrite upd_off.
Qed.

Variable d : nat.

Lemma group_decompv i w0 (F : T -> {ffun 'I_N -> T} -> 'rV[R]_d) :
  (forall w Y Y', (forall j, j != i -> Y j = Y' j) -> F w Y = F w Y') ->
  \sum_(Y : {ffun 'I_N -> T}) (\prod_j P (Y j)) *: F (Y i) Y =
  \sum_(Y : {ffun 'I_N -> T} | Y i == w0) (\prod_(j | j != i) P (Y j)) *: \sum_w P w *: F w Y.
Proof.
move=> Finv; apply/rowP => k; rewrite !summxE.
have := @group_decomp i w0 (fun w Y => F w Y 0 k).
move=> /(_ (fun w Y Y' YY => congr1 (fun M : 'rV[R]_d => M 0 k) (Finv w Y Y' YY))) /= H.
rewrite (eq_bigr (fun Y : {ffun 'I_N -> T} => (\prod_j P (Y j)) * F (Y i) Y 0 k)) ?H; last first.
  by move=> Y _; rewrite mxE.
by apply: eq_bigr => Y _; rewrite mxE summxE; congr (_ * _); apply: eq_bigr => w _; rewrite mxE.
Qed.

(* With P summing to 1: the others' probabilities, member i's draw fixed, sum to 1. *)
Lemma others_sum1 i w0 : \sum_w P w = 1 ->
  \sum_(Y : {ffun 'I_N -> T} | Y i == w0) \prod_(j | j != i) P (Y j) = 1.
Proof.
move=> P1; have := @group_decomp i w0 (fun _ _ => 1) (fun _ _ _ _ => erefl).
rewrite (eq_bigr (fun w => P w)) => [|w _]; last by rewrite mulr1.
rewrite P1; under eq_bigr do rewrite mulr1.
under [in RHS]eq_bigr do rewrite mulr1.
rewrite -(bigA_distr_bigA (fun (_ : 'I_N) (w : T) => P w)) /= => <-.
by rewrite big1 // => j _; rewrite P1.
Qed.

End GroupSums.

Section F7.
Variables (R : realFieldType) (X V : finType) (L d : nat).
Variable stop : pred V.
Variable rho : X -> R.
Variable pi : X -> seq (option V) -> V -> R.
Variable score : X -> seq (option V) -> V -> 'rV[R]_d.
Variable N : nat.

Local Notation Pr := (@Pr R X V L stop rho pi).
Local Notation Omega := (Omega X V L).
Local Notation group := {ffun 'I_N -> Omega}.
Local Notation PN := (@group_law R X V L stop rho pi N).
Local Notation mask := (@mask R X V L stop).
Local Notation s_tok := (@s_tok R X V L d stop score).
Local Notation S := (@S R X V L d stop score).
Local Notation ghat := (@ghat R X V L d stop score).
Local Notation ghat_member := (@ghat_member R X V L d stop score N).
Local Notation ghat_seq_member := (@ghat_seq_member R X V L d stop score N).

(* Member i's draw has the law P: E_N[f(Y_i)] = E f. *)
Lemma member_marginal : prompt_law rho -> policy stop pi ->
  forall i (f : Omega -> 'rV[R]_d), Ev PN (fun Y => f (Y i)) = Ev Pr f.
Proof.
move=> Hrho Hpi i f; case: (pickP (@predT Omega)) => [w0 _|emp]; last first.
  by rewrite /Ev !big1 // => [w|Y] _; [have := emp w | have := emp (Y i)].
rewrite /Ev /group_law (@group_decompv _ _ _ Pr _ i w0 (fun w (_ : group) => f w)) //.
by rewrite -scaler_suml (@others_sum1 _ _ _ Pr i w0) ?scale1r // Pr_sum1.
Qed.

(* (a), the core: E_N[F(h_t^i, Y) m_t^i s_t^i] = 0 for every F that reads member i's prefix and the others. *)
Lemma loo_orthogonal : policy stop pi -> zero_mean_score stop pi score ->
  forall i t (F : X -> seq (option V) -> group -> R),
  (forall x h (Y Y' : group), (forall j, j != i -> Y j = Y' j) -> F x h Y = F x h Y') ->
  Ev PN (fun Y => (mask t (Y i) * F (Y i).1 (hist t (Y i)) Y) *: s_tok t (Y i)) = 0.
Proof.
move=> Hpi Hs i t F Finv; case: (pickP (@predT Omega)) => [w0 _|emp]; last first.
  by rewrite /Ev big1 // => Y _; have := emp (Y i).
rewrite /Ev /group_law (@group_decompv _ _ _ Pr _ i w0 (fun w Y => (mask t w * F w.1 (hist t w) Y) *: s_tok t w)); last first.
  by move=> w Y Y' YY; rewrite (Finv _ _ Y Y').
rewrite big1 // => Y _; have := F1_prefix_baseline_orthogonal L rho Hpi Hs t (fun x h => F x h Y).
by rewrite /Ev => ->; rewrite scaler0.
Qed.

(* F7 (a): leave-one-out baselines keep member i's estimator exactly unbiased: E_N g^i = E g_0. *)
Theorem F7_loo_unbiased : prompt_law rho -> policy stop pi -> zero_mean_score stop pi score ->
  forall (G : nat -> Omega -> R) (Bg : 'I_N -> nat -> X -> seq (option V) -> group -> R),
  reads_others Bg -> forall i, Ev PN (ghat_member G Bg i) = Ev Pr (ghat G (fun=> 0)).
Proof.
move=> Hrho Hpi Hs G Bg HB i.
rewrite (Ev_ext PN (G := fun Y => ghat G (fun=> 0) (Y i) -
           \sum_(t < L) (mask t (Y i) * Bg i t (Y i).1 (hist t (Y i)) Y) *: s_tok t (Y i))); last first.
  move=> Y; rewrite /ghat_member /Defs.ghat -sumrB; apply: eq_bigr => t _.
  by rewrite subr0 -scalerBl mulrBr.
rewrite EvB member_marginal // [X in _ - X]Ev_sum big1 ?subr0 // => t _.
by apply: loo_orthogonal => // x h Y Y' YY; exact: HB.
Qed.

(* ... and the group average (1/N) sum_i g^i. *)
Corollary F7_group_unbiased : prompt_law rho -> policy stop pi -> zero_mean_score stop pi score ->
  forall (G : nat -> Omega -> R) (Bg : 'I_N -> nat -> X -> seq (option V) -> group -> R),
  reads_others Bg -> (0 < N)%N ->
  Ev PN (fun Y => N%:R^-1 *: \sum_(i < N) ghat_member G Bg i Y) = Ev Pr (ghat G (fun=> 0)).
Proof.
move=> Hrho Hpi Hs G Bg HB N0; rewrite EvZ Ev_sum.
rewrite (eq_bigr (fun _ => Ev Pr (ghat G (fun=> 0)))) => [|i _]; last exact: F7_loo_unbiased.
by rewrite sumr_const card_ord -scaler_nat scalerA mulVf ?scale1r // pnatr_eq0 -lt0n.
Qed.

(* THEORY §3's leave-one-out baseline reads only the others, for every energy W and every eps. *)
Lemma loo_baseline_reads_others (W G : nat -> Omega -> R) (eps : R) :
  reads_others (fun (i : 'I_N) t (_ : X) (_ : seq (option V)) Y => loo_baseline stop W G eps i t Y).
Proof.
move=> i t x h Y Y' YY; rewrite /loo_baseline /loo_mean.
have E (f : Omega -> R) : \sum_(j < N | j != i) f (Y j) = \sum_(j < N | j != i) f (Y' j).
  by apply: eq_bigr => j ji; rewrite YY.
by rewrite (E (fun w => mask t w * W t w)) (E (fun w => mask t w * G t w)) (E (mask t))
           (E (fun w => mask t w * W t w * G t w)).
Qed.

Corollary F7_loo_baseline_unbiased : prompt_law rho -> policy stop pi -> zero_mean_score stop pi score ->
  forall (W G : nat -> Omega -> R) (eps : R) i,
  Ev PN (ghat_member G (fun (i : 'I_N) t _ _ Y => loo_baseline stop W G eps i t Y) i) = Ev Pr (ghat G (fun=> 0)).
Proof. by move=> Hrho Hpi Hs W G eps i; apply: F7_loo_unbiased => //; exact: loo_baseline_reads_others. Qed.

(* Sequence level: S^i (R_i - b^-i) with b^-i any function of the others has mean E[S R]. *)
Theorem F7_seq_loo_unbiased : prompt_law rho -> policy stop pi -> zero_mean_score stop pi score ->
  forall (Rw : Omega -> R) (b : 'I_N -> group -> R),
  (forall i (Y Y' : group), (forall j, j != i -> Y j = Y' j) -> b i Y = b i Y') ->
  forall i, Ev PN (ghat_seq_member Rw b i) = Ev Pr (fun w => Rw w *: S w).
Proof.
move=> Hrho Hpi Hs Rw b Hb i.
rewrite (Ev_ext PN (G := fun Y => Rw (Y i) *: S (Y i) -
           \sum_(t < L) (mask t (Y i) * b i Y) *: s_tok t (Y i))); last first.
  move=> Y; rewrite /Defs.ghat_seq_member scalerBl; congr (_ - _).
  rewrite /Defs.S scaler_sumr; apply: eq_bigr => t _.
  by rewrite mulrC -scalerA s_tok_mask.
rewrite EvB (member_marginal Hrho Hpi i (fun w => Rw w *: S w)) [X in _ - X]Ev_sum big1 ?subr0 // => t _.
have := @loo_orthogonal Hpi Hs i t (fun (_ : X) (_ : seq (option V)) (Y : group) => b i Y).
by move=> /(_ (fun x h Y Y' YY => Hb i Y Y' YY)).
Qed.

Corollary F7_seq_loo_baseline_unbiased : prompt_law rho -> policy stop pi -> zero_mean_score stop pi score ->
  forall (v Rw : Omega -> R) (eps : R) i,
  Ev PN (ghat_seq_member Rw (seq_loo_baseline v Rw eps) i) = Ev Pr (fun w => Rw w *: S w).
Proof.
move=> Hrho Hpi Hs v Rw eps i; apply: F7_seq_loo_unbiased => // {}i Y Y' YY.
rewrite /seq_loo_baseline /mean_others.
have E (f : Omega -> R) : \sum_(j < N | j != i) f (Y j) = \sum_(j < N | j != i) f (Y' j).
  by apply: eq_bigr => j ji; rewrite YY.
by rewrite (E v) (E Rw) (E (fun w => v w * Rw w)).
Qed.

(* F7 (b), identically: member i's return minus the include-self plain mean is (N-1)/N times its return minus the
   leave-one-out plain mean, for every group (N >= 2). *)
Theorem F7_include_self_identity : (1 < N)%N -> forall (f : Omega -> R) i (Y : group),
  f (Y i) - mean_all f Y = ((N - 1)%:R / N%:R) * (f (Y i) - mean_others f i Y).
Proof.
move=> N1 f i Y; rewrite /mean_all /mean_others (bigD1 i) //=.
exact: self_loo.
Qed.

Lemma mean_others_reads_others (f : Omega -> R) i (Y Y' : group) :
  (forall j, j != i -> Y j = Y' j) -> mean_others f i Y = mean_others f i Y'.
Proof. by move=> YY; rewrite /mean_others; congr (_ / _); apply: eq_bigr => j ji; rewrite YY. Qed.

(* Sequence level, in expectation: E_N[S^i (R_i - Rbar)] = ((N-1)/N) E[S R]. *)
Corollary F7_include_self_seq : prompt_law rho -> policy stop pi -> zero_mean_score stop pi score ->
  (1 < N)%N -> forall (Rw : Omega -> R) i,
  Ev PN (fun Y => (Rw (Y i) - mean_all Rw Y) *: S (Y i)) = ((N - 1)%:R / N%:R) *: Ev Pr (fun w => Rw w *: S w).
Proof.
move=> Hrho Hpi Hs N1 Rw i.
rewrite (Ev_ext PN (G := fun Y => ((N - 1)%:R / N%:R) *: ghat_seq_member Rw (mean_others Rw) i Y)).
  by rewrite EvZ F7_seq_loo_unbiased // => {}i Y Y'; exact: mean_others_reads_others.
by move=> Y; rewrite /Defs.ghat_seq_member scalerA F7_include_self_identity.
Qed.

(* Token level with the plain mean of G_t over all N members (the mean of the alive ones when all lengths are
   equal): the include-self estimator is (N-1)/N times the leave-one-out one, identically and in expectation. *)
Corollary F7_include_self_token : prompt_law rho -> policy stop pi -> zero_mean_score stop pi score ->
  (1 < N)%N -> forall (G : nat -> Omega -> R) i,
  Ev PN (fun Y => \sum_(t < L) (mask t (Y i) * (G t (Y i) - mean_all (G t) Y)) *: s_tok t (Y i)) =
  ((N - 1)%:R / N%:R) *: Ev Pr (ghat G (fun=> 0)).
Proof.
move=> Hrho Hpi Hs N1 G i.
rewrite (Ev_ext PN (G := fun Y => ((N - 1)%:R / N%:R) *:
           ghat_member G (fun (i : 'I_N) t _ _ Y => mean_others (G t) i Y) i Y)).
  by rewrite EvZ F7_loo_unbiased // => {}i t x h Y Y'; exact: mean_others_reads_others.
move=> Y; rewrite /Defs.ghat_member scaler_sumr; apply: eq_bigr => t _.
by rewrite scalerA F7_include_self_identity // mulrCA.
Qed.

End F7.

(* F7 (d): a group of one.  The leave-one-out baseline averages no one: it is 0 (the rule's convention, THEORY
   §3), so the estimator is REINFORCE, sample by sample. *)
Section Singleton.
Variables (R : realFieldType) (X V : finType) (L d : nat).
Variable stop : pred V.
Variable score : X -> seq (option V) -> V -> 'rV[R]_d.

Theorem F7_singleton (W G : nat -> Omega X V L -> R) (eps : R) (i : 'I_1) t (Y : {ffun 'I_1 -> Omega X V L}) :
  loo_baseline stop W G eps i t Y = 0.
Proof.
have P0 : (fun j : 'I_1 => j != i) =1 xpred0 by move=> j; rewrite !ord1 eqxx.
rewrite /loo_baseline /loo_mean !(big_pred0 _ _ _ _ P0) invr0 !mulr0 add0r; case: ifP => // _.
by rewrite addr0 mul0r.
Qed.

Corollary F7_singleton_reinforce (W G : nat -> Omega X V L -> R) (eps : R) (i : 'I_1) (Y : {ffun 'I_1 -> Omega X V L}) :
  ghat_member stop score G (fun (i : 'I_1) t _ _ Y => loo_baseline stop W G eps i t Y) i Y =
  ghat stop score G (fun=> 0) (Y i).
Proof. by apply: eq_bigr => t _; rewrite F7_singleton. Qed.

End Singleton.
