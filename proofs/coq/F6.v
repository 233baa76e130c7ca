(* F6 (THEORY.md §2; proofs/F6 (i), (ii), (v)): the logit-gradient proxy.  For a probability vector p on a finite
   vocabulary and a token y: ||e_y - p||^2 = 1 - 2 p_y + sum_v p_v^2, it lies in [0, 2], and it is 0 iff p = e_y.
   (The gradient identity grad_z log softmax(z)_y = e_y - softmax(z) needs real analysis and is not formalised.) *)
From mathcomp Require Import all_ssreflect all_algebra.
From OTB Require Import Defs Lemmas.

Set Implicit Arguments.
Unset Strict Implicit.
Unset Printing Implicit Defensive.

Import GRing.Theory Num.Theory Order.TTheory.
Local Open Scope ring_scope.

Section F6.
Variables (R : realFieldType) (V : finType).
Implicit Types (p e : V -> R) (y : V).

Lemma sum_delta y (F : V -> R) : \sum_v (v == y)%:R * F v = F y.
Proof.
rewrite (bigD1 y) //= eqxx mul1r big1 ?addr0 // => v /negPf ->.
by rewrite mul0r.
Qed.

(* F6 (i): the identity.  Only sum_v p v = 1 is used. *)
Theorem F6_proxy_identity p y : \sum_v p v = 1 ->
  proxy_energy p y = 1 - 2 * p y + \sum_v p v ^+ 2.
Proof.
move=> p1; rewrite /proxy_energy /logit_grad.
rewrite (eq_bigr (fun v => (v == y)%:R - ((v == y)%:R * p v) *+ 2 + p v ^+ 2)); last first.
  by move=> v _; rewrite sqrrB; case: (v == y); rewrite /= ?mulr1n ?mulr0n ?expr1n ?expr0n.
rewrite big_split /= sumrB sumrMnl sum_delta.
rewrite (eq_bigr (fun v => (v == y)%:R * 1)) ?sum_delta; last by move=> v _; rewrite mulr1.
by rewrite mul2r.
Qed.

Lemma prob_le1 p v : (forall u, 0 <= p u) -> \sum_u p u = 1 -> p v <= 1.
Proof.
move=> p0 p1; rewrite -p1 (bigD1 v) //= ler_addl.
by apply: sumr_ge0 => u _.
Qed.

(* F6 (i): the bounds 0 <= ||e_y - p||^2 <= 2 for a probability vector p. *)
Theorem F6_proxy_bounds p y : (forall v, 0 <= p v) -> \sum_v p v = 1 ->
  0 <= 1 - 2 * p y + \sum_v p v ^+ 2 <= 2.
Proof.
move=> p0 p1; rewrite -F6_proxy_identity //; apply/andP; split.
  by apply: sumr_ge0 => v _; exact: sqr_ge0.
have h1 : \sum_v p v ^+ 2 <= 1.
  by rewrite -p1; apply: ler_sum => v _; rewrite expr2 ler_pimulr // prob_le1.
rewrite F6_proxy_identity //; apply: (@le_trans _ _ (1 + \sum_v p v ^+ 2)).
  by rewrite ler_add2r ler_subl_addr ler_addl mul2r mulrn_wge0.
by rewrite -[2]/(1 + 1) ler_add2l.
Qed.

(* F6 (i): ||e_y - p||^2 = 0 iff p = e_y (for any vector p). *)
Theorem F6_proxy_zero p y : proxy_energy p y = 0 <-> (forall v, p v = (v == y)%:R).
Proof.
rewrite /proxy_energy /logit_grad; split => [/eqP|pe]; last first.
  by rewrite big1 // => v _; rewrite pe subrr expr0n.
rewrite psumr_eq0 => [/allP H v|v _]; last exact: sqr_ge0.
have /implyP := H v (mem_index_enum _); rewrite sqrf_eq0 subr_eq0 => /(_ isT) /eqP.
by move=> ->.
Qed.

Corollary F6_proxy_zero_prob p y : \sum_v p v = 1 ->
  1 - 2 * p y + \sum_v p v ^+ 2 = 0 <-> (forall v, p v = (v == y)%:R).
Proof. by move=> p1; rewrite -F6_proxy_identity //; exact: F6_proxy_zero. Qed.

(* F6 (ii), its algebra: with p v = e v / sum_u e u (e = exp(z - max z) in the library), sum_v p_v^2 =
   sum_v e_v^2 / (sum_v e_v)^2, and multiplying every e v by c <> 0 (shifting the logits) changes nothing. *)
Theorem F6_sum_sq_ratio e : \sum_v (e v / \sum_u e u) ^+ 2 = (\sum_v e v ^+ 2) / (\sum_u e u) ^+ 2.
Proof. by rewrite mulr_suml; apply: eq_bigr => v _; rewrite expr_div_n. Qed.

Theorem F6_sum_sq_ratio_scale e c : c != 0 ->
  (\sum_v (c * e v) ^+ 2) / (\sum_u c * e u) ^+ 2 = (\sum_v e v ^+ 2) / (\sum_u e u) ^+ 2.
Proof.
move=> c0; rewrite -mulr_sumr exprMn.
rewrite (eq_bigr (fun v => c ^+ 2 * e v ^+ 2)) => [|v _]; last by rewrite exprMn.
by rewrite -mulr_sumr invfM mulrACA divff ?mul1r // expf_neq0.
Qed.

(* F6 (v): the LM head.  The gradient of log softmax(U h)_y in U is the outer product (e_y - p) h^T; its squared
   Frobenius norm is ||e_y - p||^2 ||h||^2 = (1 - 2 p_y + sum_v p_v^2) ||h||^2. *)
Theorem F6_lm_head p y k (h : 'I_k -> R) : \sum_v p v = 1 ->
  \sum_v \sum_(j < k) (logit_grad p y v * h j) ^+ 2 = (1 - 2 * p y + \sum_v p v ^+ 2) * \sum_(j < k) h j ^+ 2.
Proof.
move=> p1; rewrite -F6_proxy_identity // /proxy_energy mulr_suml; apply: eq_bigr => v _.
by rewrite mulr_sumr; apply: eq_bigr => j _; rewrite exprMn.
Qed.

End F6.
