(* Setting (S) and Lemma L0 of proofs/F1: the law of padded responses sums to 1 from every prefix, and given the
   prefix h_t the next token has law q(. | h_t) (the "tower" form: E f(h_t, y_t) = E sum_o q(o | h_t) f(h_t, o)). *)
From mathcomp Require Import all_ssreflect all_algebra.
From OTB Require Import Defs Lemmas.

Set Implicit Arguments.
Unset Strict Implicit.
Unset Printing Implicit Defensive.

Import GRing.Theory Num.Theory Order.TTheory.
Local Open Scope ring_scope.

Section L0.
Variables (R : realFieldType) (X V : finType) (L d : nat).
Variable stop : pred V.
Variable rho : X -> R.
Variable pi : X -> seq (option V) -> V -> R.

Local Notation alive := (alive stop).
Local Notation q := (q stop pi).
Local Notation law_from := (law_from stop pi).
Local Notation Pr := (@Pr R X V L stop rho pi).
Local Notation Omega := (Omega X V L).
Local Notation mask := (@mask R X V L stop).

Lemma q_sum1 : policy stop pi -> forall x h, \sum_o q x h o = 1.
Proof.
move=> Hpi x h; rewrite sum_option /q; case: ifP => [al|_].
  by rewrite add0r; case: (Hpi x h al).
by rewrite big1 ?addr0.
Qed.

Lemma law_from_cons x h n o (y : seq (option V)) :
  law_from x h n.+1 (o :: y) = q x h o * law_from x (rcons h o) n y.
Proof.
rewrite /Defs.law_from big_ord_recl /= cats0; congr (_ * _).
by apply: eq_bigr => i _; rewrite cat_rcons.
Qed.

(* Step 1 of L0: C(h) = 1, the completions of any prefix have total probability 1. *)
Lemma law_sum1 : policy stop pi -> forall x n h, \sum_(y : n.-tuple (option V)) law_from x h n y = 1.
Proof.
move=> Hpi x; elim=> [|n IH] h.
  by rewrite sum_tuple0 /Defs.law_from big_ord0.
rewrite sum_tuple_cons -[RHS](q_sum1 Hpi x h); apply: eq_bigr => o _.
by rewrite -[RHS]mulr1 -(IH (rcons h o)) mulr_sumr; apply: eq_bigr => y _; rewrite law_from_cons.
Qed.

(* The tower rule for the token at position t of the n tokens that follow h. *)
Lemma tower_from : policy stop pi -> forall x (f : seq (option V) -> option V -> R) n h t, (t < n)%N ->
  \sum_(y : n.-tuple (option V)) law_from x h n y * f (h ++ take t y) (nth None y t) =
  \sum_(y : n.-tuple (option V)) law_from x h n y * \sum_o q x (h ++ take t y) o * f (h ++ take t y) o.
Proof.
move=> Hpi x f; elim=> [//|n IH] h [|t] lt; rewrite !sum_tuple_cons.
  transitivity (\sum_o q x h o * f h o).
    apply: eq_bigr => o _.
    rewrite (eq_bigr (fun y : n.-tuple (option V) => q x h o * f h o * law_from x (rcons h o) n y)); last first.
      by move=> y _; rewrite law_from_cons /= cats0 mulrAC.
    by rewrite -mulr_sumr law_sum1 // mulr1.
  rewrite [RHS](eq_bigr (fun o => q x h o * \sum_o0 q x h o0 * f h o0)); last first.
    move=> o _; rewrite (eq_bigr (fun y : n.-tuple (option V) => q x h o * (\sum_o0 q x h o0 * f h o0) * law_from x (rcons h o) n y)).
      by rewrite -mulr_sumr law_sum1 // mulr1.
    by move=> y _; rewrite law_from_cons /= cats0 mulrAC.
  by rewrite -mulr_suml q_sum1 // mul1r.
apply: eq_bigr => o _.
have IHo := IH (rcons h o) t lt.
rewrite (eq_bigr (fun y : n.-tuple _ => q x h o * (law_from x (rcons h o) n y *
            f (rcons h o ++ take t y) (nth None y t)))); last first.
  by move=> y _; rewrite law_from_cons /= -cat_rcons mulrA.
rewrite [RHS](eq_bigr (fun y : n.-tuple _ => q x h o * (law_from x (rcons h o) n y *
            \sum_o' q x (rcons h o ++ take t y) o' * f (rcons h o ++ take t y) o'))); last first.
  by move=> y _; rewrite law_from_cons /= -cat_rcons mulrA.
by rewrite -!mulr_sumr IHo.
Qed.

(* E f = sum_x rho x sum_y law(y | x) f (x, y). *)
Lemma Er_Pr (f : Omega -> R) :
  Er Pr f = \sum_x rho x * \sum_(y : L.-tuple (option V)) law_from x [::] L y * f (x, y).
Proof.
rewrite /Er; under [RHS]eq_bigr do rewrite mulr_sumr.
rewrite pair_big /=; apply: eq_bigr => -[x y] _ /=.
by rewrite /Defs.Pr mulrA.
Qed.

Lemma tower : policy stop pi -> forall t (f : X -> seq (option V) -> option V -> R), (t < L)%N ->
  Er Pr (fun w => f w.1 (hist t w) (tok t w)) =
  Er Pr (fun w => \sum_o q w.1 (hist t w) o * f w.1 (hist t w) o).
Proof.
move=> Hpi t f lt; rewrite !Er_Pr; apply: eq_bigr => x _; congr (_ * _).
exact: (tower_from Hpi x (f x) [::] lt).
Qed.

(* Lemma L0, first claim: P(h_t = h, y_t = o) = P(h_t = h) q(o | h). *)
Theorem L0_next_token : policy stop pi -> forall t x0 h0 o0, (t < L)%N ->
  Er Pr (fun w => [&& w.1 == x0, hist t w == h0 & tok t w == o0]%:R) =
  Er Pr (fun w => [&& w.1 == x0 & hist t w == h0]%:R) * q x0 h0 o0.
Proof.
move=> Hpi t x0 h0 o0 lt.
rewrite (tower Hpi (fun x h o => [&& x == x0, h == h0 & o == o0]%:R) lt) -mulrC -ErZ.
apply: Er_ext => w; rewrite (bigD1 o0) //= eqxx big1 => [|o /negPf ->]; last by rewrite !andbF mulr0.
rewrite addr0 andbT; case: (w.1 =P x0) => [->|_]; last by rewrite /= mulr0n !mulr0.
by case: (hist t w =P h0) => [->|_]; rewrite /= ?mulr0n ?mulr0.
Qed.

(* Lemma L0, second claim (conditional form, multiplied by P(h_t = h)):
   E[1{h_t = h} m_t f(h_t, y_t)] = E[1{h_t = h}] m_t(h) sum_v pi(v | h) f(h, v). *)
Theorem L0_conditional : policy stop pi -> forall t x0 h0 (f : X -> seq (option V) -> V -> R), (t < L)%N ->
  Er Pr (fun w => [&& w.1 == x0 & hist t w == h0]%:R * mask t w *
                  (if tok t w is Some v then f w.1 (hist t w) v else 0)) =
  Er Pr (fun w => [&& w.1 == x0 & hist t w == h0]%:R) * ((alive h0)%:R * \sum_v pi x0 h0 v * f x0 h0 v).
Proof.
move=> Hpi t x0 h0 f lt.
rewrite (tower Hpi (fun x h o => [&& x == x0 & h == h0]%:R * (alive h)%:R *
                                  (if o is Some v then f x h v else 0)) lt) -mulrC -ErZ.
apply: Er_ext => w; rewrite /= mulrC.
have [->|_] := eqVneq w.1 x0; last by rewrite /= mulr0n !mulr0 big1 // => o _; rewrite mul0r mulr0.
have [->|_] := eqVneq (hist t w) h0; last by rewrite /= mulr0n !mulr0 big1 // => o _; rewrite mul0r mulr0.
rewrite /= sum_option /= !mulr0 !mulr1 add0r mulr_sumr /q; apply: eq_bigr => v _.
by case: (alive h0); rewrite /= ?mul1r ?mul0r ?mulr0.
Qed.

(* The law is nonnegative. *)
Lemma Pr_ge0 : prompt_law rho -> policy stop pi -> forall w, 0 <= Pr w.
Proof.
move=> [rho0 _] Hpi [x y]; apply: mulr_ge0; first exact: rho0.
apply: prodr_ge0 => i _; rewrite /Defs.q; case: ifP => al; last by case: (nth _ _ _) => [v|]; rewrite ?lexx ?ler01.
case: (nth _ _ _) => [v|]; last by rewrite lexx.
by case: (Hpi x _ al).
Qed.

(* The law sums to 1. *)
Lemma Pr_sum1 : prompt_law rho -> policy stop pi -> \sum_w Pr w = 1.
Proof.
move=> [_ rho1] Hpi; have := Er_Pr (fun=> 1); rewrite /Er.
under eq_bigr do rewrite mulr1.
move=> ->; rewrite -[RHS]rho1; apply: eq_bigr => x _.
by under eq_bigr do rewrite mulr1; rewrite law_sum1 // mulr1.
Qed.

End L0.
