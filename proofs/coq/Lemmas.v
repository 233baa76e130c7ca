(* Algebra used by every fact: the inner product, linearity of E, sums over tuples and over option types. *)
From mathcomp Require Import all_ssreflect all_algebra.
From OTB Require Import Defs.

Set Implicit Arguments.
Unset Strict Implicit.
Unset Printing Implicit Defensive.

Import GRing.Theory Num.Theory Order.TTheory.
Local Open Scope ring_scope.

(* The numeral 2 of ring_scope, as a repeated sum. *)
Lemma mul2r (R : ringType) (x : R) : 2 * x = x *+ 2.
Proof. by rewrite -mulr_natl. Qed.

(* Completing the square: with c = C / A (0 when A = 0), A b^2 - 2 C b = A (b - c)^2 - C c,
   whenever A <> 0 or C = 0. *)
Lemma quad_gap (R : fieldType) (A C b : R) : (A != 0) \/ (C = 0) ->
  A * b ^+ 2 - 2 * C * b = A * (b - C / A) ^+ 2 - C * (C / A).
Proof.
case=> [A0|->]; last by rewrite !(mul0r, mulr0, subr0).
set c := C / A; have -> : C = A * c by rewrite /c mulrC divfK.
rewrite sqrrB mulrDr mulrBr -(mulrA A c c) -expr2 addrK.
by rewrite mul2r mulrnAl mulrnAr (mulrC b c) [A * (c * b)]mulrA.
Qed.

Lemma sq_expand (R : comRingType) (r b s : R) : (r - b) ^+ 2 * s = s * r ^+ 2 - 2 * b * (s * r) + b ^+ 2 * s.
Proof.
rewrite sqrrB mulrDl mulrBl [r ^+ 2 * s]mulrC; congr (_ - _ + _).
by rewrite -mulrA mul2r mulrnAl [r * b]mulrC -mulrA [r * s]mulrC.
Qed.

Lemma quad_reorder (R : comRingType) (A C D b : R) : D - 2 * b * C + b ^+ 2 * A = A * b ^+ 2 - 2 * C * b + D.
Proof.
rewrite addrC addrA addrAC [b ^+ 2 * A]mulrC; congr (_ - _ + _).
by rewrite -mulrA [b * C]mulrC mulrA.
Qed.

Lemma add_shuffle (R : zmodType) (a X Y Z : R) : a - X + Y - Z = a - Z + (Y - X).
Proof. by rewrite -!addrA; congr (_ + _); rewrite addrC -addrA addrCA. Qed.

(* Include-self against leave-one-out plain means: a - (a + s)/N = ((N-1)/N) (a - s/(N-1)), N >= 2. *)
Lemma self_loo (R : realFieldType) (N : nat) (a s : R) : (1 < N)%N ->
  a - (a + s) / N%:R = ((N - 1)%:R / N%:R) * (a - s / (N - 1)%:R).
Proof.
move=> N1; have n0 : (N%:R : R) != 0 by rewrite pnatr_eq0 -lt0n ltnW.
have n1 : ((N - 1)%:R : R) != 0 by rewrite pnatr_eq0 subn_eq0 -ltnNge.
apply: (mulIf n0); rewrite mulrBl (divfK n0) mulrAC (divfK n0) mulrBr mulrCA (divff n1) mulr1.
by rewrite natrB ?(ltnW N1) // mulrBl mul1r [N%:R * a]mulrC opprD addrA.
Qed.

Section DotLemmas.
Variables (R : realFieldType) (d : nat).
Implicit Types (u v w : 'rV[R]_d) (a : R).

Lemma dotC u v : dot u v = dot v u.
Proof. by apply: eq_bigr => k _; rewrite mulrC. Qed.

Lemma dotDl u v w : dot (u + v) w = dot u w + dot v w.
Proof. by rewrite /dot -big_split; apply: eq_bigr => k _; rewrite mxE mulrDl. Qed.

Lemma dotDr u v w : dot u (v + w) = dot u v + dot u w.
Proof. by rewrite dotC dotDl !(dotC u). Qed.

Lemma dotZl a u v : dot (a *: u) v = a * dot u v.
Proof. by rewrite /dot mulr_sumr; apply: eq_bigr => k _; rewrite mxE mulrA. Qed.

Lemma dotZr a u v : dot u (a *: v) = a * dot u v.
Proof. by rewrite dotC dotZl dotC. Qed.

Lemma dotNl u v : dot (- u) v = - dot u v.
Proof. by rewrite -scaleN1r dotZl mulN1r. Qed.

Lemma dotNr u v : dot u (- v) = - dot u v.
Proof. by rewrite dotC dotNl dotC. Qed.

Lemma dotBl u v w : dot (u - v) w = dot u w - dot v w.
Proof. by rewrite dotDl dotNl. Qed.

Lemma dotBr u v w : dot u (v - w) = dot u v - dot u w.
Proof. by rewrite dotDr dotNr. Qed.

Lemma dot0l v : dot 0 v = 0.
Proof. by rewrite /dot big1 // => k _; rewrite mxE mul0r. Qed.

Lemma dot0r v : dot v 0 = 0.
Proof. by rewrite dotC dot0l. Qed.

Lemma dot_suml I (r : seq I) (Pi : pred I) (F : I -> 'rV[R]_d) v :
  dot (\sum_(i <- r | Pi i) F i) v = \sum_(i <- r | Pi i) dot (F i) v.
Proof.
elim/big_rec2: _ => [|i y1 y2 _ <-]; first by rewrite dot0l.
by rewrite dotDl.
Qed.

Lemma dot_sumr I (r : seq I) (Pi : pred I) (F : I -> 'rV[R]_d) v :
  dot v (\sum_(i <- r | Pi i) F i) = \sum_(i <- r | Pi i) dot v (F i).
Proof. by rewrite dotC dot_suml; apply: eq_bigr => i _; rewrite dotC. Qed.

Lemma sqnorm_ge0 u : 0 <= sqnorm u.
Proof. by apply: sumr_ge0 => k _; rewrite -expr2 sqr_ge0. Qed.

Lemma sqnormZ a u : sqnorm (a *: u) = a ^+ 2 * sqnorm u.
Proof. by rewrite /sqnorm dotZl dotZr mulrA expr2. Qed.

Lemma sqnormD u v : sqnorm (u + v) = sqnorm u + 2 * dot u v + sqnorm v.
Proof.
by rewrite /sqnorm dotDl !dotDr (dotC v u) mulr_natl mulr2n !addrA.
Qed.

Lemma sqnormB u v : sqnorm (u - v) = sqnorm u - 2 * dot u v + sqnorm v.
Proof.
rewrite sqnormD dotNr /sqnorm dotNl dotNr opprK.
by rewrite mulrN.
Qed.

Lemma sqnorm_eq0 u : (sqnorm u == 0) = (u == 0).
Proof.
apply/idP/eqP => [|->]; last by rewrite /sqnorm dot0l.
rewrite psumr_eq0 => [/allP H|k _]; last by rewrite -expr2 sqr_ge0.
apply/rowP => k; rewrite mxE; have /implyP := H k (mem_index_enum _).
by move=> /(_ isT); rewrite -expr2 sqrf_eq0 => /eqP.
Qed.

End DotLemmas.

Section ExpectationLemmas.
Variables (R : realFieldType) (Omega : finType) (d : nat) (P : Omega -> R).
Implicit Types (f g : Omega -> R) (F G : Omega -> 'rV[R]_d).

Lemma ErD f g : Er P (fun w => f w + g w) = Er P f + Er P g.
Proof. by rewrite /Er -big_split; apply: eq_bigr => w _; rewrite mulrDr. Qed.

Lemma ErB f g : Er P (fun w => f w - g w) = Er P f - Er P g.
Proof.
by rewrite /Er -sumrB; apply: eq_bigr => w _; rewrite mulrBr.
Qed.

Lemma ErZ a f : Er P (fun w => a * f w) = a * Er P f.
Proof. by rewrite /Er mulr_sumr; apply: eq_bigr => w _; rewrite mulrCA. Qed.

Lemma Er_sum I (r : seq I) (Pi : pred I) (f : I -> Omega -> R) :
  Er P (fun w => \sum_(i <- r | Pi i) f i w) = \sum_(i <- r | Pi i) Er P (f i).
Proof.
rewrite /Er exchange_big /=; apply: eq_bigr => w _.
by rewrite mulr_sumr.
Qed.

Lemma Er_ext f g : (forall w, f w = g w) -> Er P f = Er P g.
Proof. by move=> fg; apply: eq_bigr => w _; rewrite fg. Qed.

Lemma Ev_ext F G : (forall w, F w = G w) -> Ev P F = Ev P G.
Proof. by move=> FG; apply: eq_bigr => w _; rewrite FG. Qed.

Lemma EvD F G : Ev P (fun w => F w + G w) = Ev P F + Ev P G.
Proof. by rewrite /Ev -big_split; apply: eq_bigr => w _; rewrite scalerDr. Qed.

Lemma EvB F G : Ev P (fun w => F w - G w) = Ev P F - Ev P G.
Proof. by rewrite /Ev -sumrB; apply: eq_bigr => w _; rewrite scalerBr. Qed.

Lemma EvZ a F : Ev P (fun w => a *: F w) = a *: Ev P F.
Proof. by rewrite /Ev scaler_sumr; apply: eq_bigr => w _; rewrite !scalerA mulrC. Qed.

Lemma Ev_sum I (r : seq I) (Pi : pred I) (F : I -> Omega -> 'rV[R]_d) :
  Ev P (fun w => \sum_(i <- r | Pi i) F i w) = \sum_(i <- r | Pi i) Ev P (F i).
Proof.
rewrite /Ev exchange_big /=; apply: eq_bigr => w _.
by rewrite scaler_sumr.
Qed.

(* A component of E F is E of the component. *)
Lemma Ev_comp F k : Ev P F 0 k = Er P (fun w => F w 0 k).
Proof. by rewrite /Ev summxE; apply: eq_bigr => w _; rewrite mxE. Qed.

(* E <u, F> = <u, E F> for a constant u. *)
Lemma Er_dotr u F : Er P (fun w => dot u (F w)) = dot u (Ev P F).
Proof.
rewrite /Er /Ev dot_sumr; apply: eq_bigr => w _.
by rewrite dotZr.
Qed.

(* A nonnegative variable with zero mean under a nonnegative P vanishes where P > 0. *)
Lemma Er_eq0_ge0 f : (forall w, 0 <= P w) -> (forall w, 0 <= f w) -> Er P f = 0 ->
  forall w, P w * f w = 0.
Proof.
move=> P0 f0 /eqP; rewrite psumr_eq0 => [/allP H w|w _]; last by rewrite mulr_ge0.
by apply/eqP; have /implyP := H w (mem_index_enum _); apply.
Qed.

End ExpectationLemmas.

Section SumLemmas.
Variables (R : realFieldType) (T : finType).

(* A sum over (n+1)-tuples splits into the first token and the rest. *)
Lemma sum_tuple_cons n (F : n.+1.-tuple T -> R) :
  \sum_(y : n.+1.-tuple T) F y = \sum_(o : T) \sum_(y : n.-tuple T) F [tuple of o :: y].
Proof.
rewrite pair_big /=.
rewrite (reindex (fun p : T * n.-tuple T => [tuple of p.1 :: p.2])) //=.
exists (fun y : n.+1.-tuple T => (thead y, [tuple of behead y])) => [[o y] _|y _] /=.
  by congr pair; apply: val_inj.
by case/tupleP: y => o y; apply: val_inj.
Qed.

Lemma sum_tuple0 (F : 0.-tuple T -> R) : \sum_(y : 0.-tuple T) F y = F [tuple].
Proof.
rewrite (big_pred1 [tuple]) // => y /=; apply/esym/eqP/val_inj.
by case: y => -[].
Qed.

(* A sum over option T: the padding symbol None, then the tokens. *)
Lemma sum_option (F : option T -> R) : \sum_(o : option T) F o = F None + \sum_(v : T) F (Some v).
Proof.
rewrite [index_enum (option_finType T)]unlock Finite.EnumDef.enumDef /= big_cons big_map.
by rewrite [index_enum T]unlock Finite.EnumDef.enumDef.
Qed.

End SumLemmas.
