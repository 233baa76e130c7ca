(* The finite probability notions of docs/THEORY.md, defined once (issue 39).

   Everything is over an arbitrary real field R ([realFieldType]: the rationals, the real algebraic numbers, ...).
   Gradients live in R^d, as row vectors ['rV[R]_d]; d is arbitrary.  Every expectation is a finite sum. *)
From mathcomp Require Import all_ssreflect all_algebra.

Set Implicit Arguments.
Unset Strict Implicit.
Unset Printing Implicit Defensive.

Import GRing.Theory Num.Theory.
Local Open Scope ring_scope.

(* ---------------------------------------------------------------------------------------------------------------- *)
(* Inner product and squared norm on R^d.                                                                            *)
Section Vectors.
Variables (R : realFieldType) (d : nat).

Definition dot (u v : 'rV[R]_d) : R := \sum_(k < d) u 0 k * v 0 k.
Definition sqnorm (u : 'rV[R]_d) : R := dot u u.

End Vectors.

(* ---------------------------------------------------------------------------------------------------------------- *)
(* A finite probability space (Omega, P): E g = sum_w P w *: g w; Var g = E ||g||^2 - ||E g||^2.                     *)
Section FiniteProbability.
Variables (R : realFieldType) (Omega : finType) (d : nat).
Variable P : Omega -> R.

(* P is a probability: nonnegative, summing to 1. *)
Definition is_prob : Prop := (forall w, 0 <= P w) /\ \sum_w P w = 1.

(* E g for a vector-valued g, and E f for a real-valued f. *)
Definition Ev (g : Omega -> 'rV[R]_d) : 'rV[R]_d := \sum_w P w *: g w.
Definition Er (f : Omega -> R) : R := \sum_w P w * f w.

(* Var g = E||g||^2 - ||E g||^2 (the trace of the covariance). *)
Definition Var (g : Omega -> 'rV[R]_d) : R := Er (fun w => sqnorm (g w)) - sqnorm (Ev g).

End FiniteProbability.

(* ---------------------------------------------------------------------------------------------------------------- *)
(* F6: for a probability vector p on a vocabulary V and a token y, the logit gradient e_y - p and the proxy energy
   ||e_y - p||^2. *)
Section Proxy.
Variables (R : realFieldType) (V : finType).

Definition logit_grad (p : V -> R) (y v : V) : R := (v == y)%:R - p v.
Definition proxy_energy (p : V -> R) (y : V) : R := \sum_v logit_grad p y v ^+ 2.

End Proxy.

(* ---------------------------------------------------------------------------------------------------------------- *)
(* Setting (S) of proofs/F1: padded responses of length L over a vocabulary V, prompts in X.

   A token is [option V]: [Some v] a token of V, [None] the padding symbol.  [stop] is the set of tokens that end a
   response (EOS; [pred0] for none).  A response is an L-tuple of tokens; positions are 0-based: position t
   (t = 0 .. L-1, THEORY's t + 1) is sampled at the prefix h_t = (x, y_0 .. y_(t-1)).

   The only probabilistic primitives are the prompt law [rho] and the per-prefix policy [pi x h], a probability
   vector on V at every prefix h that has not stopped; the law of the padded response is
     P (x, y) = rho x * prod_t q x h_t y_t,
   with q x h = pi x h on V and 0 on padding while h is alive, and the point mass on padding afterwards. *)
Section Setting.
Variables (R : realFieldType) (X V : finType) (L d : nat).
Variable stop : pred V.
Variable rho : X -> R.
Variable pi : X -> seq (option V) -> V -> R.
(* score x h v = grad_theta log pi(v | x, h), a vector of R^d; only its per-prefix mean is assumed (below). *)
Variable score : X -> seq (option V) -> V -> 'rV[R]_d.

Definition Omega : finType := [finType of (X * L.-tuple (option V))%type].

(* A prefix is alive while it holds no stop token (and no padding). *)
Definition alive (h : seq (option V)) : bool :=
  all (fun o => if o is Some v then ~~ stop v else false) h.

Definition q (x : X) (h : seq (option V)) (o : option V) : R :=
  if alive h then (if o is Some v then pi x h v else 0) else (if o is None then 1 else 0).

(* The law of the n tokens that follow the prefix h: prod_(i < n) q x (h ++ y_<i) y_i. *)
Definition law_from (x : X) (h : seq (option V)) (n : nat) (y : seq (option V)) : R :=
  \prod_(i < n) q x (h ++ take i y) (nth None y i).

(* The law of (x, y). *)
Definition Pr (w : Omega) : R := rho w.1 * law_from w.1 [::] L w.2.

(* y_<t, the token y_t, the mask m_t = 1{t <= T} (T the length), the token score s_t = m_t grad log pi(y_t | h_t),
   S_t = sum_(j <= t) s_j and S = S_(L-1). *)
Definition hist (t : nat) (w : Omega) : seq (option V) := take t w.2.
Definition tok (t : nat) (w : Omega) : option V := nth None w.2 t.
Definition mask (t : nat) (w : Omega) : R := (alive (hist t w))%:R.
Definition s_tok (t : nat) (w : Omega) : 'rV[R]_d :=
  if alive (hist t w) then (if tok t w is Some v then score w.1 (hist t w) v else 0) else 0.
Definition S_upto (t : nat) (w : Omega) : 'rV[R]_d := \sum_(j < L | (j <= t)%N) s_tok j w.
Definition S (w : Omega) : 'rV[R]_d := \sum_(j < L) s_tok j w.

(* The hypotheses: rho and every pi x h (h alive) are probability vectors; the score has zero mean at every alive
   prefix, sum_v pi(v | x, h) score x h v = 0 (what d/dtheta sum_v pi = 0 gives for a differentiable policy). *)
Definition prompt_law : Prop := (forall x, 0 <= rho x) /\ \sum_x rho x = 1.
Definition policy : Prop := forall x h, alive h -> (forall v, 0 <= pi x h v) /\ \sum_v pi x h v = 1.
Definition zero_mean_score : Prop := forall x h, alive h -> \sum_v pi x h v *: score x h v = 0.

(* ---------------------------------------------------------------------------------------------------------------- *)
(* The estimators, by THEORY's formulas.                                                                             *)

(* F3: g_b = S (R - b) for a constant b; b* = E[||S||^2 R] / E||S||^2 (0 when E||S||^2 = 0: mathcomp's x / 0 = 0). *)
Definition ghat_seq (Rw : Omega -> R) (b : R) (w : Omega) : 'rV[R]_d := (Rw w - b) *: S w.
Definition bstar (Rw : Omega -> R) : R :=
  Er Pr (fun w => sqnorm (S w) * Rw w) / Er Pr (fun w => sqnorm (S w)).

(* g_B = sum_t m_t s_t (G_t - B_t(h_t)) for baselines B_t(h_t) that read the prefix (F1), and for constants B_t (F4);
   G_t is any real function of (x, y) (the return to go in THEORY; nothing below needs more). *)
Definition ghat_prefix (G : nat -> Omega -> R) (B : nat -> X -> seq (option V) -> R) (w : Omega) : 'rV[R]_d :=
  \sum_(t < L) (mask t w * (G t w - B t w.1 (hist t w))) *: s_tok t w.
Definition ghat (G : nat -> Omega -> R) (B : nat -> R) (w : Omega) : 'rV[R]_d :=
  \sum_(t < L) (mask t w * (G t w - B t)) *: s_tok t w.

(* F4: B**_t = E[m_t <s_t, g_0>] / E[m_t ||s_t||^2] (0 where the denominator is 0). *)
Definition energy_at (t : nat) : R := Er Pr (fun w => mask t w * sqnorm (s_tok t w)).
Definition Bss (G : nat -> Omega -> R) (t : nat) : R :=
  Er Pr (fun w => mask t w * dot (s_tok t w) (ghat G (fun=> 0) w)) / energy_at t.

(* F5: the population OTB baseline E[m_t W_t G_t] / E[m_t W_t] for an energy W. *)
Definition Botb (W G : nat -> Omega -> R) (t : nat) : R :=
  Er Pr (fun w => mask t w * W t w * G t w) / Er Pr (fun w => mask t w * W t w).

(* ---------------------------------------------------------------------------------------------------------------- *)
(* F7: a group Y = (Y_0 .. Y_(N-1)) of N independent draws of the law above, P_N(Y) = prod_i P(Y_i).              *)
Definition group_law (N : nat) (Y : {ffun 'I_N -> Omega}) : R := \prod_(i < N) Pr (Y i).

(* Member i's estimator sum_t m_t s_t (G_t - Bg_t), its baselines Bg i t (x, h) Y read member i's prefix h_t and
   the group. *)
Definition ghat_member (N : nat) (G : nat -> Omega -> R)
    (Bg : 'I_N -> nat -> X -> seq (option V) -> {ffun 'I_N -> Omega} -> R) (i : 'I_N) (Y : {ffun 'I_N -> Omega}) :
    'rV[R]_d :=
  \sum_(t < L) (mask t (Y i) * (G t (Y i) - Bg i t (Y i).1 (hist t (Y i)) Y)) *: s_tok t (Y i).

(* Leave-one-out: member i's baselines read only the others (and member i's own prefix). *)
Definition reads_others (N : nat) (Bg : 'I_N -> nat -> X -> seq (option V) -> {ffun 'I_N -> Omega} -> R) : Prop :=
  forall i t x h (Y Y' : {ffun 'I_N -> Omega}), (forall j, j != i -> Y j = Y' j) -> Bg i t x h Y = Bg i t x h Y'.

(* THEORY §3's leave-one-out token baseline at position t: over the others alive at t, with energy weights
   a_j = m_t W_t^j and their plain mean Gbar (0 when none is alive),
     B = (sum_(j <> i) a_j G_t^j + eps Gbar) / (sum_(j <> i) a_j + eps),   and B = Gbar where the denominator is 0. *)
Definition loo_mean (N : nat) (G : nat -> Omega -> R) (t : nat) (i : 'I_N) (Y : {ffun 'I_N -> Omega}) : R :=
  (\sum_(j < N | j != i) mask t (Y j) * G t (Y j)) / (\sum_(j < N | j != i) mask t (Y j)).
Definition loo_baseline (N : nat) (W G : nat -> Omega -> R) (eps : R) (i : 'I_N) (t : nat)
    (Y : {ffun 'I_N -> Omega}) : R :=
  let den := \sum_(j < N | j != i) mask t (Y j) * W t (Y j) + eps in
  if den == 0 then loo_mean G t i Y
  else (\sum_(j < N | j != i) mask t (Y j) * W t (Y j) * G t (Y j) + eps * loo_mean G t i Y) / den.

(* Sequence level: member i's estimator S (R - b), and THEORY's leave-one-out baseline
   b = (sum_(j <> i) v_j R_j + eps Rbar) / (sum_(j <> i) v_j + eps) (Rbar where the denominator is 0). *)
Definition ghat_seq_member (N : nat) (Rw : Omega -> R) (b : 'I_N -> {ffun 'I_N -> Omega} -> R) (i : 'I_N)
    (Y : {ffun 'I_N -> Omega}) : 'rV[R]_d := (Rw (Y i) - b i Y) *: S (Y i).
Definition mean_others (N : nat) (f : Omega -> R) (i : 'I_N) (Y : {ffun 'I_N -> Omega}) : R :=
  (\sum_(j < N | j != i) f (Y j)) / (N - 1)%:R.
Definition mean_all (N : nat) (f : Omega -> R) (Y : {ffun 'I_N -> Omega}) : R := (\sum_(j < N) f (Y j)) / N%:R.
Definition seq_loo_baseline (N : nat) (v Rw : Omega -> R) (eps : R) (i : 'I_N) (Y : {ffun 'I_N -> Omega}) : R :=
  let den := \sum_(j < N | j != i) v (Y j) + eps in
  if den == 0 then mean_others Rw i Y
  else (\sum_(j < N | j != i) v (Y j) * Rw (Y j) + eps * mean_others Rw i Y) / den.

(* GRPO's std scaling (sequence level): A_i = (R_i - Rbar) / sigma, sigma the group's reward std (any sigma >= 0
   with sigma^2 = sum_j (R_j - Rbar)^2 / k: k = N - 1 for the unbiased std, k = N for the population std). *)
Definition sq_dev (N : nat) (Rw : Omega -> R) (Y : {ffun 'I_N -> Omega}) : R :=
  \sum_(j < N) (Rw (Y j) - mean_all Rw Y) ^+ 2.
Definition ghat_seq_std (N : nat) (Rw : Omega -> R) (sigma : {ffun 'I_N -> Omega} -> R) (i : 'I_N)
    (Y : {ffun 'I_N -> Omega}) : 'rV[R]_d := ((Rw (Y i) - mean_all Rw Y) / sigma Y) *: S (Y i).

End Setting.

Arguments mask {R X V L} stop t w.
