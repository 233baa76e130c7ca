(* F5 (THEORY.md §2; proofs/F5): OTB with exact energies W_t = ||S_t||^2 is prefix-optimal.  For every position t,
   q_t(b) = E||m_t S_t (G_t - b)||^2 = q_t(Botb_t) + E[m_t W_t] (b - Botb_t)^2 with
   Botb_t = E[m_t W_t G_t] / E[m_t W_t]; and at the last position, with outcome reward and equal lengths (almost
   surely), Botb equals F3's bstar (EOB).  G_t is any real function of (x, y). *)
From mathcomp Require Import all_ssreflect all_algebra.
From OTB Require Import Defs Lemmas L0 F1 F3.

Set Implicit Arguments.
Unset Strict Implicit.
Unset Printing Implicit Defensive.

Import GRing.Theory Num.Theory Order.TTheory.
Local Open Scope ring_scope.

Section F5.
Variables (R : realFieldType) (X V : finType) (L d : nat).
Variable stop : pred V.
Variable rho : X -> R.
Variable pi : X -> seq (option V) -> V -> R.
Variable score : X -> seq (option V) -> V -> 'rV[R]_d.

Local Notation Pr := (@Pr R X V L stop rho pi).
Local Notation Omega := (Omega X V L).
Local Notation mask := (@mask R X V L stop).
Local Notation S := (@S R X V L d stop score).
Local Notation S_upto := (@S_upto R X V L d stop score).
Local Notation Botb := (@Botb R X V L stop rho pi).
Local Notation bstar := (@bstar R X V L d stop rho pi score).

(* The exact energy W_t = ||S_t||^2. *)
Definition exact_energy (t : nat) (w : Omega) : R := sqnorm (S_upto t w).

Lemma mask_sq t w : mask t w ^+ 2 = mask t w.
Proof. by rewrite /Defs.mask; case: (alive _ _); rewrite ?expr1n ?expr0n. Qed.

(* F5 (a): the exact quadratic gap of the prefix objective. *)
Theorem F5_prefix_optimal : prompt_law rho -> policy stop pi ->
  forall (G : nat -> Omega -> R) (t : nat) (b : R),
  Er Pr (fun w => sqnorm ((mask t w * (G t w - b)) *: S_upto t w)) =
  Er Pr (fun w => sqnorm ((mask t w * (G t w - Botb exact_energy G t)) *: S_upto t w)) +
  Er Pr (fun w => mask t w * exact_energy t w) * (b - Botb exact_energy G t) ^+ 2.
Proof.
move=> Hrho Hpi G t b.
set A := Er Pr (fun w => mask t w * exact_energy t w).
set C := Er Pr (fun w => mask t w * exact_energy t w * G t w).
set D := Er Pr (fun w => mask t w * exact_energy t w * G t w ^+ 2).
have q c : Er Pr (fun w => sqnorm ((mask t w * (G t w - c)) *: S_upto t w)) = A * c ^+ 2 - 2 * C * c + D.
  rewrite -quad_reorder -ErZ -ErZ -ErB -ErD; apply: Er_ext => w.
  by rewrite sqnormZ exprMn mask_sq -/(exact_energy t w) mulrAC mulrC sq_expand.
have AC : (A != 0) \/ (C = 0).
  have [A0|A0] := eqVneq A 0; [right | by left].
  have H := Er_eq0_ge0 (Pr_ge0 Hrho Hpi) (fun w => mulr_ge0 (ler0n _ _) (sqnorm_ge0 (S_upto t w))) A0.
  by rewrite /C /Er big1 // => w _; rewrite mulrA H mul0r.
rewrite !q /Botb -/A -/C [A * _ ^+ 2 - _]quad_gap // [A * (C / A) ^+ 2 - _]quad_gap // subrr expr0n /= mulr0.
by rewrite sub0r [RHS]addrC addrA.
Qed.

Corollary F5_prefix_minimiser : prompt_law rho -> policy stop pi ->
  forall (G : nat -> Omega -> R) (t : nat) (b : R),
  Er Pr (fun w => sqnorm ((mask t w * (G t w - Botb exact_energy G t)) *: S_upto t w)) <=
  Er Pr (fun w => sqnorm ((mask t w * (G t w - b)) *: S_upto t w)).
Proof.
move=> Hrho Hpi G t b; rewrite [X in _ <= X](F5_prefix_optimal Hrho Hpi G t b) ler_addl mulr_ge0 ?sqr_ge0 //.
by apply: sumr_ge0 => w _; rewrite mulr_ge0 ?Pr_ge0 // mulr_ge0 ?ler0n ?sqnorm_ge0.
Qed.

(* F5 (b): at the last position, with outcome reward (G = R there) and equal lengths (m = 1 there) on every
   response of positive probability, OTB with exact energies is EOB. *)
Theorem F5_last_position_is_eob : (0 < L)%N -> forall (G : nat -> Omega -> R) (Rw : Omega -> R),
  (forall w, Pr w != 0 -> mask L.-1 w = 1 /\ G L.-1 w = Rw w) ->
  Botb exact_energy G L.-1 = bstar Rw.
Proof.
move=> L0 G Rw H.
have SL w : S_upto L.-1 w = S w.
  by rewrite /Defs.S_upto /Defs.S; apply: eq_bigl => j; rewrite -ltnS prednK // ltn_ord.
rewrite /Botb /bstar /exact_energy; congr (_ / _); apply: eq_bigr => w _; rewrite SL.
  have [P0|/H [-> ->]] := eqVneq (Pr w) 0; first by rewrite P0 !mul0r.
  by rewrite mul1r.
have [P0|/H [-> _]] := eqVneq (Pr w) 0; first by rewrite P0 !mul0r.
by rewrite mul1r.
Qed.

End F5.
