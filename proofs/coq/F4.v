(* F4 (THEORY.md §2; proofs/F4): the variance-optimal per-position constant baseline Bss (B** in THEORY.md).  For every
   vector of constants B: Var(B) = Var(Bss) + sum_t E[m_t ||s_t||^2] (B_t - Bss_t)^2, a separable quadratic (by F2,
   proved in F2.v, not assumed).  Hence Var(Bss) <= Var(B) for every B (OTB's and EOB's population baselines
   included), and with outcome reward Var(Bss) <= Var(EOB) <= Var(b).  G_t is any real function of (x, y). *)
From mathcomp Require Import all_ssreflect all_algebra.
From OTB Require Import Defs Lemmas L0 F1 F2 F3.

Set Implicit Arguments.
Unset Strict Implicit.
Unset Printing Implicit Defensive.

Import GRing.Theory Num.Theory Order.TTheory.
Local Open Scope ring_scope.

Section F4.
Variables (R : realFieldType) (X V : finType) (L d : nat).
Variable stop : pred V.
Variable rho : X -> R.
Variable pi : X -> seq (option V) -> V -> R.
Variable score : X -> seq (option V) -> V -> 'rV[R]_d.

Local Notation Pr := (@Pr R X V L stop rho pi).
Local Notation Omega := (Omega X V L).
Local Notation mask := (@mask R X V L stop).
Local Notation s_tok := (@s_tok R X V L d stop score).
Local Notation S := (@S R X V L d stop score).
Local Notation ghat := (@ghat R X V L d stop score).
Local Notation ghat_seq := (@ghat_seq R X V L d stop score).
Local Notation energy_at := (@energy_at R X V L d stop rho pi score).
Local Notation Bss := (@Bss R X V L d stop rho pi score).
Local Notation Botb := (@Botb R X V L stop rho pi).
Local Notation bstar := (@bstar R X V L d stop rho pi score).

Section Expansion.
Variable G : nat -> Omega -> R.
Let g0 := ghat G (fun=> 0).
Let c t := Er Pr (fun w => mask t w * dot (s_tok t w) (g0 w)).

Lemma ghat_split (B : nat -> R) w : ghat G B w = g0 w - \sum_(t < L) B t *: s_tok t w.
Proof.
rewrite /g0 /Defs.ghat -sumrB; apply: eq_bigr => t _.
by rewrite subr0 mulrBr scalerBl [_ * B t]mulrC -(scalerA (B t)) s_tok_mask.
Qed.

Lemma dot_mask_l t (u : 'rV[R]_d) w : mask t w * dot (s_tok t w) u = dot (s_tok t w) u.
Proof. by rewrite -dotZl s_tok_mask. Qed.

(* Steps 1-3 of proofs/F4: Var(B) = Var(0) + sum_t (a_t B_t^2 - 2 c_t B_t). *)
Lemma F4_expansion : policy stop pi -> zero_mean_score stop pi score -> forall B : nat -> R,
  Var Pr (ghat G B) = Var Pr g0 + \sum_(t < L) (energy_at t * B t ^+ 2 - 2 * c t * B t).
Proof.
move=> Hpi Hs B; rewrite /Var.
have E1 : Ev Pr (ghat G B) = Ev Pr g0.
  rewrite (Ev_ext Pr (ghat_split B)) EvB [X in _ - X]Ev_sum big1 ?subr0 // => t _.
  by rewrite EvZ (F1_score_mean L rho Hpi Hs) scaler0.
have Hx : Er Pr (fun w => dot (g0 w) (\sum_(t < L) B t *: s_tok t w)) = \sum_(t < L) c t * B t.
  rewrite (Er_ext Pr (g := fun w => \sum_(t < L) B t * dot (g0 w) (s_tok t w))); last first.
    by move=> w; rewrite dot_sumr; apply: eq_bigr => t _; rewrite dotZr.
  rewrite Er_sum; apply: eq_bigr => t _; rewrite ErZ /c mulrC.
  by congr (_ * _); apply: Er_ext => w; rewrite dot_mask_l dotC.
have Hy : Er Pr (fun w => sqnorm (\sum_(t < L) B t *: s_tok t w)) = \sum_(t < L) energy_at t * B t ^+ 2.
  rewrite (Er_ext Pr (g := fun w => \sum_(t < L) \sum_(u < L) B t * B u * dot (s_tok t w) (s_tok u w))).
    rewrite Er_sum; apply: eq_bigr => t _; rewrite Er_sum (bigD1 t) //= big1 ?addr0.
      by rewrite ErZ mulrC -expr2 /energy_at /sqnorm; congr (_ * _); apply: Er_ext => w; rewrite dot_mask_l.
    move=> u /negPf tu; rewrite ErZ (Er_ext Pr (g := fun w => mask t w * mask u w * dot (s_tok t w) (s_tok u w))).
      by rewrite F2_orthogonality ?mulr0 // => /val_inj /eqP; rewrite eq_sym tu.
    by move=> w; rewrite -dot_s_tok_mask.
  move=> w; rewrite /sqnorm dot_suml; apply: eq_bigr => t _; rewrite dot_sumr; apply: eq_bigr => u _.
  by rewrite dotZl dotZr mulrA.
rewrite E1 (Er_ext Pr (fun w => congr1 (@sqnorm R d) (ghat_split B w))) (Er_ext Pr (fun w => sqnormB _ _)) ErD ErB ErZ.
rewrite Hx Hy sumrB.
rewrite [X in _ = _ + (_ - X)](eq_bigr (fun t : 'I_L => 2 * (c t * B t))) => [|t _]; last by rewrite mulrA.
by rewrite -mulr_sumr add_shuffle.
Qed.

End Expansion.

(* A position with E[m_t ||s_t||^2] = 0 has c_t = 0 (a nonnegative variable with zero mean vanishes where P > 0). *)
Lemma F4_free_position : prompt_law rho -> policy stop pi -> forall (G : nat -> Omega -> R) t,
  energy_at t = 0 -> Er Pr (fun w => mask t w * dot (s_tok t w) (ghat G (fun=> 0) w)) = 0.
Proof.
move=> Hrho Hpi G t a0.
have H := Er_eq0_ge0 (Pr_ge0 Hrho Hpi) (fun w => mulr_ge0 (ler0n _ _) (sqnorm_ge0 (s_tok t w))) a0.
rewrite /Er big1 // => w _; have := H w; rewrite /Defs.mask; case: (alive _ _) => /=; last by rewrite !mul0r mulr0.
rewrite mul1r => /eqP; rewrite mulf_eq0 => /orP[/eqP->|]; first by rewrite mul0r.
by rewrite sqnorm_eq0 => /eqP ->; rewrite dot0l !mulr0.
Qed.

(* F4: the separable quadratic gap. *)
Theorem F4_separable_gap : prompt_law rho -> policy stop pi -> zero_mean_score stop pi score ->
  forall (G : nat -> Omega -> R) (B : nat -> R),
  Var Pr (ghat G B) = Var Pr (ghat G (Bss G)) + \sum_(t < L) energy_at t * (B t - Bss G t) ^+ 2.
Proof.
move=> Hrho Hpi Hs G B; rewrite (F4_expansion G Hpi Hs B) (F4_expansion G Hpi Hs (Bss G)).
set c := fun t => Er Pr (fun w => mask t w * dot (s_tok t w) (ghat G (fun=> 0) w)).
have ac t : (energy_at t != 0) \/ (c t = 0).
  by have [a0|a0] := eqVneq (energy_at t) 0; [right; exact: F4_free_position | left].
have Bssc t : Bss G t = c t / energy_at t by [].
rewrite -addrA; congr (_ + _); rewrite -big_split /=; apply: eq_bigr => t _.
rewrite !(quad_gap _ (ac t)) -Bssc subrr expr0n /= mulr0 sub0r.
by rewrite addrC [_ * (B t - _) ^+ 2]mulrC.
Qed.

(* Corollary 1: Bss minimises Var over every vector of per-position constants, uniquely on the positions with
   E[m_t ||s_t||^2] > 0. *)
Corollary F4_minimiser : prompt_law rho -> policy stop pi -> zero_mean_score stop pi score ->
  forall (G : nat -> Omega -> R) (B : nat -> R), Var Pr (ghat G (Bss G)) <= Var Pr (ghat G B).
Proof.
move=> Hrho Hpi Hs G B; rewrite (F4_separable_gap Hrho Hpi Hs G B) ler_addl.
apply: sumr_ge0 => t _; rewrite mulr_ge0 ?sqr_ge0 // /energy_at sumr_ge0 // => w _.
by rewrite mulr_ge0 ?Pr_ge0 // mulr_ge0 ?ler0n ?sqnorm_ge0.
Qed.

Corollary F4_unique : prompt_law rho -> policy stop pi -> zero_mean_score stop pi score ->
  forall (G : nat -> Omega -> R) (B : nat -> R), Var Pr (ghat G B) <= Var Pr (ghat G (Bss G)) ->
  forall t, (t < L)%N -> 0 < energy_at t -> B t = Bss G t.
Proof.
move=> Hrho Hpi Hs G B; rewrite (F4_separable_gap Hrho Hpi Hs G B) ger_addl => H t tL a0.
have a_ge0 u : 0 <= energy_at u.
  by rewrite sumr_ge0 // => w _; rewrite mulr_ge0 ?Pr_ge0 // mulr_ge0 ?ler0n ?sqnorm_ge0.
have T0 : \sum_(u < L) energy_at u * (B u - Bss G u) ^+ 2 == 0.
  by rewrite eq_le H sumr_ge0 // => u _; rewrite mulr_ge0 ?sqr_ge0.
move: T0; rewrite psumr_eq0 => [/allP/(_ (Ordinal tL) (mem_index_enum _))|u _]; last by rewrite mulr_ge0 ?sqr_ge0.
by rewrite /= mulf_eq0 (gt_eqF a0) /= sqrf_eq0 subr_eq0 => /eqP.
Qed.

(* Corollary 2: Bss is below OTB's population baseline E[m_t W_t G_t] / E[m_t W_t] for every energy W, and below
   the constant vector (bstar, .., bstar) of F3 for every R. *)
Corollary F4_below_otb : prompt_law rho -> policy stop pi -> zero_mean_score stop pi score ->
  forall (W G : nat -> Omega -> R), Var Pr (ghat G (Bss G)) <= Var Pr (ghat G (Botb W G)).
Proof. by move=> Hrho Hpi Hs W G; exact: F4_minimiser. Qed.

Corollary F4_below_eob : prompt_law rho -> policy stop pi -> zero_mean_score stop pi score ->
  forall (G : nat -> Omega -> R) (Rw : Omega -> R), Var Pr (ghat G (Bss G)) <= Var Pr (ghat G (fun=> bstar Rw)).
Proof. by move=> Hrho Hpi Hs G Rw; exact: F4_minimiser. Qed.

(* With outcome reward (G_t = R wherever m_t = 1) the constant vector (b, .., b) is F3's estimator S (R - b). *)
Lemma ghat_outcome (G : nat -> Omega -> R) (Rw : Omega -> R) :
  (forall t w, alive stop (hist t w) -> G t w = Rw w) -> forall b w, ghat G (fun=> b) w = ghat_seq Rw b w.
Proof.
move=> HG b w; rewrite /Defs.ghat /ghat_seq /Defs.S scaler_sumr; apply: eq_bigr => t _.
rewrite /Defs.mask /Defs.s_tok; case: ifP => al; last by rewrite !scaler0.
by rewrite mul1r HG.
Qed.

(* Corollary 3: with outcome reward, Var(Bss) <= Var(EOB) <= Var(b) for every constant b. *)
Corollary F4_outcome_orderings : prompt_law rho -> policy stop pi -> zero_mean_score stop pi score ->
  forall (G : nat -> Omega -> R) (Rw : Omega -> R), (forall t w, alive stop (hist t w) -> G t w = Rw w) ->
  Var Pr (ghat G (Bss G)) <= Var Pr (ghat_seq Rw (bstar Rw)) /\
  forall b, Var Pr (ghat_seq Rw (bstar Rw)) <= Var Pr (ghat_seq Rw b).
Proof.
move=> Hrho Hpi Hs G Rw HG; split; last exact: F3_minimiser.
rewrite /Var -(Ev_ext Pr (ghat_outcome HG (bstar Rw))).
rewrite -(Er_ext Pr (fun w => congr1 (@sqnorm R d) (ghat_outcome HG (bstar Rw) w))).
exact: F4_below_eob.
Qed.

End F4.
