(* F3 (THEORY.md §2; proofs/F3): the sequence-level optimal constant baseline (EOB).  For g_b = S (R - b):
   Var(b) = Var(bstar) + (b - bstar)^2 E||S||^2 with bstar = E[||S||^2 R] / E||S||^2, so bstar is a minimiser,
   the unique one when E||S||^2 > 0.  R is any real function of (x, y). *)
From mathcomp Require Import all_ssreflect all_algebra.
From OTB Require Import Defs Lemmas L0 F1.

Set Implicit Arguments.
Unset Strict Implicit.
Unset Printing Implicit Defensive.

Import GRing.Theory Num.Theory Order.TTheory.
Local Open Scope ring_scope.

Section F3.
Variables (R : realFieldType) (X V : finType) (L d : nat).
Variable stop : pred V.
Variable rho : X -> R.
Variable pi : X -> seq (option V) -> V -> R.
Variable score : X -> seq (option V) -> V -> 'rV[R]_d.

Local Notation Pr := (@Pr R X V L stop rho pi).
Local Notation Omega := (Omega X V L).
Local Notation S := (@S R X V L d stop score).
Local Notation ghat_seq := (@ghat_seq R X V L d stop score).
Local Notation bstar := (@bstar R X V L d stop rho pi score).

Section Moments.
Variable Rw : Omega -> R.
Let A := Er Pr (fun w => sqnorm (S w)).
Let C := Er Pr (fun w => sqnorm (S w) * Rw w).
Let K := Er Pr (fun w => sqnorm (S w) * Rw w ^+ 2) - sqnorm (Ev Pr (fun w => Rw w *: S w)).

(* Var(b) = A b^2 - 2 C b + K: a quadratic in b (step 3 of proofs/F3). *)
Lemma F3_quadratic : policy stop pi -> zero_mean_score stop pi score ->
  forall b, Var Pr (ghat_seq Rw b) = A * b ^+ 2 - 2 * C * b + K.
Proof.
move=> Hpi Hs b; rewrite /Var /K addrA; congr (_ - _); last first.
  congr sqnorm; rewrite /ghat_seq (Ev_ext Pr (G := fun w => Rw w *: S w - b *: S w)); last by move=> w; rewrite scalerBl.
  by rewrite EvB EvZ (F1_S_mean L rho Hpi Hs) scaler0 subr0.
rewrite (Er_ext Pr (g := fun w => sqnorm (S w) * Rw w ^+ 2 - (2 * b) * (sqnorm (S w) * Rw w) +
                               b ^+ 2 * sqnorm (S w))); last by move=> w; rewrite /ghat_seq sqnormZ sq_expand.
by rewrite ErD ErB !ErZ -/A -/C quad_reorder.
Qed.

End Moments.

(* E||S||^2 = 0 forces E[||S||^2 R] = 0 (a nonnegative variable with zero mean vanishes where P > 0). *)
Lemma F3_degenerate : prompt_law rho -> policy stop pi -> forall Rw : Omega -> R,
  Er Pr (fun w => sqnorm (S w)) = 0 -> Er Pr (fun w => sqnorm (S w) * Rw w) = 0.
Proof.
move=> Hrho Hpi Rw A0; have H := Er_eq0_ge0 (Pr_ge0 Hrho Hpi) (fun w => sqnorm_ge0 (S w)) A0.
by rewrite /Er big1 // => w _; rewrite mulrA H mul0r.
Qed.

(* F3 (a) and (b) in one statement: the exact quadratic gap, for every constant b. *)
Theorem F3_variance_gap : prompt_law rho -> policy stop pi -> zero_mean_score stop pi score ->
  forall (Rw : Omega -> R) (b : R),
  Var Pr (ghat_seq Rw b) = Var Pr (ghat_seq Rw (bstar Rw)) + (b - bstar Rw) ^+ 2 * Er Pr (fun w => sqnorm (S w)).
Proof.
move=> Hrho Hpi Hs Rw b; rewrite !F3_quadratic // /bstar.
set A := Er Pr (fun w => sqnorm (S w)); set C := Er Pr (fun w => sqnorm (S w) * Rw w).
have AC : (A != 0) \/ (C = 0).
  by have [A0|A0] := eqVneq A 0; [right; exact: F3_degenerate | left].
rewrite (quad_gap b AC) (quad_gap (C / A) AC) subrr expr0n /= mulr0 sub0r.
by rewrite [(b - _) ^+ 2 * A]mulrC [RHS]addrC !addrA.
Qed.

Corollary F3_minimiser : prompt_law rho -> policy stop pi -> zero_mean_score stop pi score ->
  forall (Rw : Omega -> R) (b : R), Var Pr (ghat_seq Rw (bstar Rw)) <= Var Pr (ghat_seq Rw b).
Proof.
move=> Hrho Hpi Hs Rw b; rewrite [X in _ <= X](F3_variance_gap Hrho Hpi Hs Rw b) ler_addl.
by rewrite mulr_ge0 ?sqr_ge0 // sumr_ge0 // => w _; rewrite mulr_ge0 ?Pr_ge0 ?sqnorm_ge0.
Qed.

Corollary F3_unique : prompt_law rho -> policy stop pi -> zero_mean_score stop pi score ->
  forall (Rw : Omega -> R) (b : R), 0 < Er Pr (fun w => sqnorm (S w)) ->
  Var Pr (ghat_seq Rw b) <= Var Pr (ghat_seq Rw (bstar Rw)) -> b = bstar Rw.
Proof.
move=> Hrho Hpi Hs Rw b A0; rewrite (F3_variance_gap Hrho Hpi Hs Rw b) ger_addl.
rewrite pmulr_lle0 // => H; apply/eqP; rewrite -subr_eq0 -sqrf_eq0.
by rewrite eq_le H sqr_ge0.
Qed.

End F3.
