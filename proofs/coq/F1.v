(* F1 (THEORY.md §2; proofs/F1): the token score has zero conditional mean given the prefix, and baselines that
   read only the prefix leave the estimator's mean unchanged. *)
From mathcomp Require Import all_ssreflect all_algebra.
From OTB Require Import Defs Lemmas L0.

Set Implicit Arguments.
Unset Strict Implicit.
Unset Printing Implicit Defensive.

Import GRing.Theory Num.Theory Order.TTheory.
Local Open Scope ring_scope.

Section F1.
Variables (R : realFieldType) (X V : finType) (L d : nat).
Variable stop : pred V.
Variable rho : X -> R.
Variable pi : X -> seq (option V) -> V -> R.
Variable score : X -> seq (option V) -> V -> 'rV[R]_d.

Local Notation alive := (alive stop).
Local Notation q := (q stop pi).
Local Notation Pr := (@Pr R X V L stop rho pi).
Local Notation Omega := (Omega X V L).
Local Notation mask := (@mask R X V L stop).
Local Notation s_tok := (@s_tok R X V L d stop score).
Local Notation S := (@S R X V L d stop score).
Local Notation S_upto := (@S_upto R X V L d stop score).

Lemma s_tok_ge t (w : Omega) : (L <= t)%N -> s_tok t w = 0.
Proof. by move=> ge; rewrite /Defs.s_tok /tok nth_default ?size_tuple //; case: ifP. Qed.

(* The score vanishes off the mask: m_t s_t = s_t. *)
Lemma s_tok_mask t (w : Omega) : mask t w *: s_tok t w = s_tok t w.
Proof. by rewrite /Defs.mask /Defs.s_tok; case: ifP => _; rewrite ?scale1r ?scaler0. Qed.

(* The core: E[F(h_t) s_t] = 0 for every real function F of the prefix (x, y_<t). *)
Lemma prefix_mean : policy stop pi -> zero_mean_score stop pi score ->
  forall t (F : X -> seq (option V) -> R), Ev Pr (fun w => F w.1 (hist t w) *: s_tok t w) = 0.
Proof.
move=> Hpi Hs t F; case: (ltnP t L) => [lt|ge]; last first.
  by rewrite /Ev big1 // => w _; rewrite s_tok_ge // !scaler0.
apply/rowP => k; rewrite Ev_comp mxE.
pose f x h o := F x h * (if alive h then (if o is Some v then score x h v else 0) else 0 : 'rV[R]_d) 0 k.
rewrite (Er_ext Pr (g := fun w => f w.1 (hist t w) (tok t w))); last by move=> w; rewrite mxE.
rewrite tower // /Er big1 // => w _; apply/eqP; rewrite mulf_eq0; apply/orP; right.
rewrite sum_option /f /q; case: ifP => al /=; last first.
  by rewrite mxE !mulr0 add0r big1 // => v _; rewrite mxE !mulr0.
rewrite mul0r add0r (eq_bigr (fun v => F w.1 (hist t w) * (pi w.1 (hist t w) v *: score w.1 (hist t w) v) 0 k)).
  by rewrite -mulr_sumr -summxE Hs // mxE mulr0.
by move=> v _; rewrite mxE mulrCA.
Qed.

(* F1(a), conditional form: E[s_t 1{h_t = (x0, h0)}] = 0 for every prefix value, i.e. E[s_t | h_t] = 0. *)
Theorem F1_zero_mean_score : policy stop pi -> zero_mean_score stop pi score ->
  forall t x0 h0, Ev Pr (fun w => [&& w.1 == x0 & hist t w == h0]%:R *: s_tok t w) = 0.
Proof. by move=> Hpi Hs t x0 h0; exact: (prefix_mean Hpi Hs t (fun x h => [&& x == x0 & h == h0]%:R)). Qed.

Corollary F1_score_mean : policy stop pi -> zero_mean_score stop pi score -> forall t, Ev Pr (s_tok t) = 0.
Proof.
move=> Hpi Hs t; rewrite -(prefix_mean Hpi Hs t (fun _ _ => 1)).
by apply: Ev_ext => w; rewrite scale1r.
Qed.

Corollary F1_S_mean : policy stop pi -> zero_mean_score stop pi score -> Ev Pr S = 0.
Proof.
move=> Hpi Hs; rewrite (Ev_ext Pr (G := fun w => \sum_(t < L) s_tok t w)) // Ev_sum.
by rewrite big1 // => t _; exact: F1_score_mean.
Qed.

Corollary F1_S_upto_mean : policy stop pi -> zero_mean_score stop pi score ->
  forall t, Ev Pr (S_upto t) = 0.
Proof.
move=> Hpi Hs t; rewrite (Ev_ext Pr (G := fun w => \sum_(j < L | (j <= t)%N) s_tok j w)) // Ev_sum.
by rewrite big1 // => j _; exact: F1_score_mean.
Qed.

(* F1(b): a baseline B_t(h_t) that reads only the prefix: E[m_t s_t B_t(h_t)] = 0 and E g_B = E g_0,
   for any G. *)
Theorem F1_prefix_baseline_orthogonal : policy stop pi -> zero_mean_score stop pi score ->
  forall t (B : X -> seq (option V) -> R), Ev Pr (fun w => (mask t w * B w.1 (hist t w)) *: s_tok t w) = 0.
Proof. by move=> Hpi Hs t B; exact: (prefix_mean Hpi Hs t (fun x h => (alive h)%:R * B x h)). Qed.

Theorem F1_prefix_baselines_unbiased : policy stop pi -> zero_mean_score stop pi score ->
  forall (G : nat -> Omega -> R) (B : nat -> X -> seq (option V) -> R),
  Ev Pr (ghat_prefix stop score G B) = Ev Pr (ghat_prefix stop score G (fun _ _ _ => 0)).
Proof.
move=> Hpi Hs G B.
rewrite (Ev_ext Pr (F := ghat_prefix stop score G B)
  (G := fun w => ghat_prefix stop score G (fun _ _ _ => 0) w -
                 \sum_(t < L) (mask t w * B t w.1 (hist t w)) *: s_tok t w)); last first.
  move=> w; rewrite /ghat_prefix -sumrB; apply: eq_bigr => t _.
  by rewrite subr0 -scalerBl mulrBr.
rewrite EvB [X in _ - X]Ev_sum big1 ?subr0 // => t _.
exact: F1_prefix_baseline_orthogonal.
Qed.

End F1.
