"""Stage costs of a repeated stack from one block's plan: the fast path of the stage DP (``planner.pipeline``).

A transformer is a few *special* layers (embeddings before, final norm and head after) around L identical
*blocks*. The exact stage table (``pipeline._StageTable``) runs the intra-operator search of every range of
layers on every submesh shape — O(L) distinct searches per shape even with identical ranges shared
(``stage.range_keys``), each over a slice that grows with the range, and the capture itself traces all L
blocks. Here a stage is priced from *pieces* planned once per (logical mesh, memory cap):

1. The stack (:func:`find_stack`, :func:`capture_stack`)
-------------------------------------------------------
The model's layers (``stage.runnable_layers``: the split the DP and the runtime share) are ``p`` pre layers, the
blocks ``c.0 .. c.(L−1)`` of one container ``c`` (a ``ModuleList``, at any depth: ``model.model.layers`` in a
Hugging Face Llama), and ``q`` post layers. It is a *repeated stack* when the middle blocks ``c.1 .. c.(L−2)`` slice
into the same problem one at a time and two at a time (``range_keys``: same operators, edges, boundary tensors and
sharing) and L ≥ :data:`MIN_BLOCKS` (first, two middles, last: the capture's backward makes the first and last
blocks unlike the others). :func:`capture_stack` captures a model with only :data:`KEEP` of its L blocks (the
container cut short for the trace, then restored) and lays out the L-block model's layers from it
(:attr:`Stack.layers`: the first, a middle block repeated, the last), so the trace costs a few blocks, not L. A
graph of all L blocks is a stack too (:func:`find_stack`), with pieces from its own layers.

2. Pieces and their composition (:class:`StackTable`)
-----------------------------------------------------
A stage of layers ``[start, stop)`` is a pre part ``P = [a, min(stop, p))`` (when ``start < p``), k blocks,
and a post part ``Q`` (when ``stop > p + L``). For each submesh size d, logical shape (a, b) and cap level
ℓ, the pieces are planned by ``StagePlanner.plan_with_memory`` on the captured graph — every sub-range of
the pre layers and of the post layers at the device's capacity, one *middle* block (graph layer ``p + 1``)
under a cap that starts at the device's capacity (the levels below). With each piece x's step over B
microbatches ``t_x`` (its ``StageCost.time``) and memory parts (``stage.StageMemory``: static ``W+O+I``,
gradients ``G``, update temporaries ``U``, saved activations ``A``, live peak ``V``):

    t(stage)          = t_P + k · t_blk + t_Q                                          → ``T``
    static            = s_P + k · s_blk + s_Q                                          → ``static``
    forward_backward  = static + max over pieces x of (V_x + Σ_{y ≠ x} c_y)
                        + Σ_x acc_x                                                    → ``fb``
    c_y               = max(A_y + K_y, G_y, H_y)                                       → ``StageMemory.carry``
    update            = static + Σ_x (G_x + U_x)                                       → ``upd``
    activations       = A_P + k · A_blk + A_Q                                          → ``act``

(a block repeated k times counts as k pieces in the max: its own peak with the other k − 1 blocks' carries;
``acc_x`` the piece's gradients summed over the microbatches, ``StageMemory.accumulated``, held beside every
node from the second microbatch on, as ``auto.plan`` — and so ``Plan.with_intra`` — counts them; each piece's
ILP holds them on its backward row too. Left out, GPT-39B's last stage of 10 blocks and the head composed to
15.3 GiB and planned at 22.7: its ZeRO-3 blocks' summed gradients are whole, 0.8 GiB a block on 4x2).
The carry ``c_y`` bounds what piece y holds while x peaks: its saved activations ``A_y`` when x runs before
y's backward (with ``K_y``, ``StageMemory.saved_held``: a ZeRO-3 replica's gathered weights that the backward
reads through a saved view, section 5; 0 for a searched piece), its gradients after — as the backward produces
them, ``H_y`` (``StageMemory.grads_held``, ``accounting.Liveness.produced``), held to the end of the stage's
backward where they are reduced, at least the stored ``G_y``. Under ZeRO-3 ``H_y`` is the whole partial sum and
``G_y`` its shard: carried as ``G_y``, GPT-6.7B's ``[0,18)@8x1`` (16 selectively recomputing ZeRO-3 blocks, 2
microbatches in flight) read 14.6 GiB in both tables and needed 17.7 GiB once planned (its peak: the end of
the backward, every block's gradient whole beside their sum over the microbatches); with ``H_y`` 17.8. A
searched piece's own kept copies (its liveness keeps a gathered weight under a saved view too) are left out of
``K``: a stage's own search keeps fewer of them than its block alone (GPT-6.7B's ``[18,36)@8x1`` under ZeRO-3:
0.12 GiB a block, its block alone 0.375), and carried they priced that stage's capped block at 16.6 GiB where
its own plan needs 15.9: the estimated table's final plan was then 8.7 % slower. A range with no block is a
piece itself (exact). A stage of one piece is exactly the exact table's cost; one of k > 1 blocks assumes the
blocks chain with no resharding between them (the block's plan read as its own successor: the layout it leaves
its output in is the one it takes its input in — the tests hold the fast path to the exact path's plan and step
on small GPTs).

Eq. 5 then reads ``max(upd, fb + (f(s) − 1) · act) ≤ capacity`` (``pipeline.stage_memory``), vectorised over
every range and stage count at once per (shape, level) (``StackTable.arrays``). Levels trade time for memory:
the ILP of one block given the whole device keeps its state where it is fastest (replicated on an axis, no
ZeRO), which k such blocks may not afford. When at level ℓ some range of blocks useful on that submesh fits
with no number of stages after it, the block is planned again (level ℓ + 1, at most :data:`MAX_LEVELS`)
under its own peak scaled by how far k_ℓ blocks of it overflow the device (``_cap_for``), k_ℓ the fewest
blocks of such a range and at least twice the previous level's (so the levels reach the largest ranges in
a few steps), the cap at most 0.9 of the previous one; a cap the ILP cannot meet ends the levels, and so
does a level aimed at as many blocks as the largest such range or more: the next would aim past every range
(GPT-2.6B's 32 blocks, over the device on 4x2 at 0.573 GiB, aimed the next level at 64: 0.276 GiB, where no
plan fits; with 2x4's alike, 7 of the row's 24 CPU s). Unlike the floors' cuts (section 3) this end is no
proof: a tighter cap may still fit a range its own level missed (one with many microbatches in flight, which
``_cap_for`` leaves out), so it was checked on the Alpa GPT rows: the same plans (``docs/benchmarks.md``,
issue 31's planning time, "a level aimed past every range"). Each
(range, size, s) keeps the fastest (shape, level) that fits. ``t_intra = T / B`` goes to the same DP
(``pipeline._dp``) as the exact table's, and the chosen stages are composed again on the ranks ``place`` gives them
(:func:`compose_stage`, which the Megatron-3D baseline of ``benchmarks/bench_alpa_table.py`` uses too).

After its cap levels the table offers the *recomputing* blocks (:data:`RECOMPUTING`, section 4): the block of
the graph whose blocks recompute their selective regions, then of the one recomputing them whole, each at the
device's capacity and with its ZeRO-3 answer, where that graph's own floors show it may change an entry
(section 3; ``plan_pipeline(recompute=)`` says which kinds, ``"none"``: none). Recomputation trades compute for
saved activations, which a stage with f(s) microbatches in flight holds f(s) times over: where the cap levels
only fit by sharding more (or nothing fits), a recomputing block may be the faster way (Alpa recomputes every
stage, §9). A stage composed from one is marked (``StageCost.recompute``) and planned and run so.

3. Which meshes and cap levels are searched (``StackTable.arrays``, ``prune``)
-------------------------------------------------------------------------------
Each entry of the table is the least ``(t, o)`` over the candidates that fit it, ``o`` the candidate's place
in the enumeration order (shape in ``shapes(d)`` order, then level): what searching in that order and keeping
strict improvements gives. Before a logical mesh X of size d is searched, and before each further cap level
of it, its *floors* (``StagePlanner.floor``: every node's compute and every parameter's update at their
cheapest strategy, each memory term at its least — lower bounds of any plan of the piece on X under any
cap) bound every candidate X can still give, per range ``(k, i)`` and stage count s:

    t      ≥ t_low(k, i)     = (f_P.t + NB · f_blk.t + f_Q.t) / B                            → ``_lower``
    Eq. 5  ≥ need(s, k, i)   = max(f_P.u + NB · f_blk.u + f_Q.u,
                                   f_P.b + NB · f_blk.b + f_Q.b + (f(s) − 1) · (f_P.a + NB · f_blk.a + f_Q.a))

(``u``: the update row ``static + grads + update_temp``, exactly ``upd``'s terms; ``b``: ``static + saved``,
at most ``fb`` since each piece's live peak holds its saved values and a carry ``max(A, G) ≥ A``; ``a``:
saved values, ``act``'s terms; f_P, f_Q of the range's pre and post pieces, 0 when it has none). X can
change an entry only if it fits (``need ≤ capacity``) and ``t_low`` is below the entry's t, or equal with X
earlier in the order (``_can_improve``). When no entry passes, X (or its remaining levels) is skipped: the
table is the same as searching it. Meshes are visited in the order of their block floor's time, so the fast
ones fill the table first and the slow ones (1x24 on 24 devices: an axis that shards little) meet entries
they cannot beat; the tie rule keeps the order-independent winner. Floors are compared less
:data:`FLOOR_MARGIN` (a floor as tight as a plan sums the same terms in another order). A level's cap is
computed as before from the previous level's plan, so the levels searched are a prefix of those the
enumeration would search. The pre and post pieces are planned only where a range useful on that size has
them. ``floor`` is a bound only
if the search's plan is priced by the same terms: the tests check it against every plan searched.

Not modelled: resharding between the pieces of a stage (the first block after the embeddings, the head
after the last block; each piece's boundary input is laid out as its search chose); the first and last
blocks are priced as the middle one (``stage.runnable_layers`` gives them the backward's residual-gradient
sums that cross them, so they differ a little: 0.06 % of the step on the tests' 4-block GPT); and the pieces'
logical mesh mapping is each piece's own (the stage reports its largest piece's).

Searches: per shape, one block (per level used) plus the pre and post sub-ranges — ``p(p+1)/2 + q(q+1)/2``,
6 for a GPT — whatever L, instead of O(L) ranges of growing size.

4. The variant table: real plans only (``TableCosting.APPROXIMATE``, :meth:`StackTable._variant_levels`)
-----------------------------------------------------------------------------------------------------
Opt-in (``plan_pipeline(costing="approximate")``, ``meshpilot plan --approximate-table``). The cap levels'
searches are what the exact table costs: a block's ILP whose memory rows bind is a knapsack HiGHS closes with
cuts (seconds each on GPT-39B's sub-GiB caps), where the same ILP without binding rows is solved at its root.
The variant table's first pass runs no capped block search and estimates nothing: per logical mesh its block
pieces (:class:`ApproxLevel`) are

* FULL: the block searched at the device's capacity (level 0 above);
* ZERO: the same answer with every replicated update ZeRO-sharded at stage 3 (``zero.ZeroMode.STAGE3``, the
  post-pass: no new ILP);
* SELECTIVE, SELECTIVE_ZERO: the same two on the *selectively recomputing* graph (:attr:`StackTable.recomputed`:
  ``config_plan.recomputed_stack``, every captured block's selective region — all but its matrix products and
  attention — copied into its backward, ``planner.recompute``): one more uncapped search of its block, its pre
  and post pieces the captured ones;
* RECOMPUTE, RECOMPUTE_ZERO: the same two on the graph recomputing every block whole;
* then, in a second pass and only where none of those fits a range, the block under memory caps (below).

each tried while some useful entry with blocks does not fit yet, and skipped where its floors show it cannot
change an entry (section 3; the recomputing block has floors of its own: it saves less). Every candidate is a
plan composed k times as section 2 composes it — the same time and memory accounting as the exact table —
so the stages the DP chooses are priced exactly by construction: :meth:`stage_cost` composes them again on
their placed ranks from the same pieces, and nothing is refined afterwards. One term more than the exact
table: the forward + backward peak holds the gradients summed over the microbatches (``fb += Σ_x w_x ·
acc_x``, ``StageMemory.accumulated``), as ``auto.plan`` — and so ``Plan.with_intra`` — counts them; a ZeRO-3
block holds that sum whole, so without the term its stages looked far smaller than their plans (the exact
table counts it too since issue 29: section 2). A stage
composed from a recomputing candidate is marked (``StageCost.recompute``): ``Plan.with_intra`` plans its slice
with its blocks recomputed and the stage runtime runs it so (``runtime.pipeline_stages``). ZeRO stage 2 is not
a variant: the pipeline runtime runs stage 3 only.

What these cannot give is a block plan that trades time for memory *inside* the ILP (a capped search shards
a few more weights, keeps fewer activations): GPT-39B's exact plan has a stage of 7 blocks on 8 devices (4x2,
two microbatches in flight) under a block capped at 0.146 of the device, which no uncapped variant fits (the
whole-recomputing ZeRO-3 block needs 1.28 of the device there), and without it the variant plan was 4.3 %
slower. So a second pass (:meth:`StackTable.refine`, called by ``pipeline._dp_plan`` after the DP has run on
the first) offers capped blocks of the captured graph — at most :data:`CAPPED_VARIANTS` per logical mesh, their
caps chosen as the exact table's levels choose theirs (``_cap_for`` of the fewest blocks of a range that fits
with no number of stages after it, at least doubling) — but only for ranges no uncapped variant of that mesh
fits, and only where they may beat the first pass' plan of step S: a plan beats it only if every stage's
t_intra is below S / B (Eq. 2's step ``Σ t + (B − 1) · max t ≥ B · max t``), and a capped block's stage is no
faster than the uncapped block's stage nor than its floors (section 3). Those candidates are plans too, composed
as the others, so the chosen stages are still priced exactly by construction. Measured in
``docs/benchmarks.md`` (the Alpa GPT rows, issue 29 item 6); it did not replace the exact table as the default,
as the capped searches of the second pass cost GPT-39B most of what the exact table's cap levels do.

5. The estimated table: a catalogue per TP degree (``TableCosting.ESTIMATED``, :meth:`StackTable._plan_catalogue`)
---------------------------------------------------------------------------------------------------------------
The CLI's default (``meshpilot plan``; ``plan_pipeline(costing="estimated")``). Both tables above search every
logical mesh; this one searches a few *base* meshes and prices every other mesh from them. For every degree b dividing a
server's GPUs that some logical mesh ``(a, b)`` of the table has, the bases are ``(1, b)`` (the first server's first b
ranks) and, where the table has meshes across servers, ``(a0, b) = (2 · server / b, b)`` (two servers: 16x1, 8x2, 4x4,
2x8 on alpa-p3x8); on each, each graph's middle block (captured, selectively and wholly recomputing) is planned once at
the device's capacity: the *catalogue*, its searches (one per base and graph) spread over the planning workers
(``planner.parallel``; what they search merged into each graph's planner). A mesh ``(a, b)`` prices its blocks from its
base — ``(1, b)`` when ``a · b`` fits in a server, else the two-server one — as ``r = a / a0`` replicas of the base's
block plan, and searches its pre and post pieces itself (below), in the columns' workers. Each replica computes ``1/r``
of the microbatch's rows (:func:`_replicated`; piece x with times ``C, K, R, O`` — compute, collectives, resharding,
optimizer — and memory parts ``s, g, u, v, l`` of ``StageMemory``, ``w = g`` its weights' bytes, ``I`` its input leaves
per device, ``AR, RS, AG`` the cost model's all-reduce, reduce-scatter and all-gather over axis 0 of ``(a, b)``):

    replicated   t = (C + K + R) / r + O + AR(w)
                 static = s − I · (1 − 1/r),  grads = w,  saved = v / r,  live = (l − w) / r + w
    ZeRO-3       t = (C + K + R + O) / r + RS(w) + B · AG(w)
                 static = s / r,  grads = w / r,  update = u / r,  saved = v / r,  live = (l − w) / r + w / r + w
                 kept K = w_back

(the weights gathered once a microbatch and kept for its backward, as ``zero``'s stage 3 prices them; ``w_back`` the
base's weights the backward reads through a view the forward saved, ``accounting.weights_read_back``: their gathered
copy is held from the forward to the backward, section 2's ``K``, so the replica carries it while another block peaks —
GPT-6.7B's ``[10,18)@4x1`` of 8 ZeRO-3 blocks read 14.3 GiB without it, 16.4 planned; a recomputing block recomputes its
views, so its ``w_back`` is 0. Both forms keep the base's ``H`` (section 2): a replica's gradients are produced as
partial sums over axis 0, whole). The base meshes themselves (r = 1) are their own plans. The second base is there
because across servers the ILP shards the weights on both axes (GPT-39B's block on 8x2: 0.94 GiB of state per device,
where a replica of 1x2's plan holds 4.5 and all-reduces it across servers), which no replica of a one-server plan shows.
On a two-server base with both axes over 1 (8x2, 4x4, 2x8) the recomputing blocks are searched after the captured one
and on the device mapping it chose there only (``StagePlanner.plan(mappings=)``): which axis crosses the servers is
what the mapping decides, and recomputation changes compute and saved bytes, not the collectives. On GPT-39B the
captured block's mapping is each recomputing block's best on 8x2 and 2x8 and on 4x4 for whole recomputation; on 4x4
the selective one's best is the other (5.5269 s against 5.5353, 0.15 %), so 3 of the table's 78,622 finite entries
price it that much higher; the plan is the same, the catalogue 7.1 → 6.1 CPU s (docs/benchmarks.md, issue 29 item 6,
tab29). A chosen stage is still composed on its own mesh with every mapping (:meth:`StackTable.stage_cost`).
The six :class:`ApproxLevel` candidates per mesh (replicated or ZeRO-3, on each graph) are offered to the same
``_offer`` as every other table's plans; a mesh with no base (b no divisor of a server, a no multiple of a0) or whose r
does not divide the microbatch's rows is not priced. Searches: 3 blocks per base, whatever the cluster's size, and at
most ``p(p+1)/2 + q(q+1)/2`` small pieces per priced mesh.

The pre and post pieces (embeddings; final norm and head) are not replicas: on every priced mesh they are searched
(``_both_specials``, at the device's capacity, only those some range useful on that size has), as the exact table
and :meth:`StackTable.stage_cost` plan them. A replica of 1x1's embedding is data parallel, its ZeRO-3 form
producing the table's gradient whole (``H = g`` of the base, and the summed gradients whole); the search on 4x1
shards the table over the vocabulary instead, its gradient produced sharded (GPT-39B: 0.199 GiB held where the
replica held 0.797, and 0.069 s of the step where it took 0.487). They are a few small searches per mesh, cheap
beside a block's (GPT-1.3B and 2.6B's tables: the same CPU within the noise). No Alpa GPT row's plan changed with
them: GPT-39B's ``[0,5)@4x1 rc`` is over the device as the first of 9 stages because its 3 ZeRO-3 blocks, composed
at full memory, carry their gradients whole (section 2's ``H``; the blocks' own plan on 4x1 is the replica's twin),
where the range's own search shards more (docs/benchmarks.md, issue 29 item 6, est29c).

The meshes of one whole server (size d = the server's GPUs: 8x1, 4x2, 2x4, 1x8 on alpa-p3x8) are searched as well,
after their replicas were offered: each one's cap levels as the exact table's (section 2, :meth:`_cap_levels`),
where its floors show a plan of it may change an entry (section 3; :meth:`StackTable._server_cap_levels`). A block
capped under the device's memory trades time for memory inside the ILP — GPT-39B's exact plan has ``[31,38)@4x2``,
7 blocks with 2 microbatches in flight under a block capped at 0.146 of the device, the weights sharded over both
axes and their summed gradients too (0.023 of the device a block, where a ZeRO-3 replica of 1x2's plan holds them
whole, 0.094) — which no replica form prices; without it the estimated plan was 6.4 % slower. That column is the
one that searches blocks, and its cap levels are the table's longest serial piece: with several planning workers
they start first in a forked process of their own (``parallel.start_task``, :meth:`StackTable._estimated_arrays`),
on empty winners, while the catalogue and then every column (that one's replicas too) are searched over the other
workers, and are merged after that column's replicas as ``_offer`` keeps them (``_merge_after``: levels pruned
against no replica only add candidates that cannot win, so the table is the one searched in one process). Of a
mesh and its transpose (4x2 and 2x4, 8x1 and 1x8) only the first in ``shapes(d)`` order is searched under cap levels
(``_transposed_earlier``): both are the same ranks, each orientation's row mapping the other's column mapping
transposed (``mesh.mapped_ranks``), so their ILPs differ only in which axis is which — not exactly, as DTensor
splits a tensor dim sharded over both axes over axis 0 first, and the capped searches' refits follow each plan's
own peak: GPT-39B's block at full memory steps 8.978 s on both, capped at 4.55 GiB 9.062 s on 4x2 against 9.095 on
2x4, and at 2.33 GiB 9.844 s on 4x2 where 2x4 finds no plan. The transpose's replicas are still offered; a stage the
DP puts on the searched orientation is then planned exactly there. It saves GPT-39B's table 11 of 51 CPU s (2x4's
levels alone 9.6), with the same plan, and leaves every Alpa GPT row's final plan as it was (docs/benchmarks.md,
issue 29 item 6, est29d). The capped levels (all but the first) are searched at a relative MIP gap of
:data:`PRICING_GAP` (1 %) where the searcher's is 0.1 % (``StagePlanner.plan(mip_gap=)``, recorded on the
candidate, ``Candidate.block_gap``, so that :meth:`stage_cost` composes the chosen stage from the same search): a
binding memory row is a knapsack HiGHS closes with cuts, and the looser gap stops it sooner — GPT-39B's 30 capped
solves of over 0.3 s took 25.3 CPU s at 0.1 % and 9.5 at 1 % (thrown-away replays of the same models), the plans'
objectives at most 0.8 % above the 0.1 % ones. Only pricing: the chosen stages are planned again at the searcher's
gap (``Plan.with_intra``). On GPT-39B's table 34.5 → 29.6 CPU s, the same stages (the table's step 81.5443 s
against 81.5490). It is an estimate, and not always a close one: each level's cap follows the previous level's plan
(``_next_cap``), so a looser plan moves every cap after it — GPT-6.7B's table step went 43.951 → 47.200 s (its 8x1
stage priced slower) while its final plan, [19,36)@8x1 where it was [18,36), went 44.440 → 43.685 s; the other four
rows' final plans are unchanged.

*Relaxed pricing* (:attr:`StackTable.relaxed`, default :data:`RELAXED_PRICING`): the pre and post pieces on every
priced mesh (``_both_specials``, at the device's capacity) are solved from their LP relaxation
(``StagePlanner.plan(relaxed=)``, ``ilp.solve(relaxed=)``): the relaxation's optimum where it is integral (the ILP's
optimum then, up to which of equal-cost plans), else the ILP over its fractional selections with the rest fixed,
within ``(z − z_LP) / z`` of the optimum (the gap each piece reports: its error bound). A chosen stage's pre and post
parts are planned by the whole ILP again (``compose_stage``), and the stages by ``Plan.with_intra``. Not relaxed,
as measured (docs/benchmarks.md, issue 29 item 6, cheap29): the capped levels (1.5 CPU s where their ILPs at
:data:`PRICING_GAP` take 18 on GPT-39B, but a level's plan decides the next level's cap, and the relaxed 2.33 GiB
level of 4x2 kept more activations: ``[31,38)@4x2`` lost, the DP's step 79.86 → 95.41 s); the catalogue's blocks
(integral relaxations on 20 of 27, but another of the equal-cost plans on 11 of those, whose memory differs: 98.93
s); a whole server's block at its first level (the same plan on GPT-39B, but GPT-6.7B's final plan 43.685 → 48.385
s, 1.087 of the exact table's).

The chosen stages are then composed from their own mesh's plans (:meth:`stage_cost`, ``compose_stage``: real plans
on the placed ranks), a composed stage that does not fit its microbatches in flight is ruled out and the DP's next
best taken (``pipeline._chosen_plan``), and each stage's ZeRO is left to its own search (``StageCost.zero`` None:
``Plan.with_intra`` plans it with ``zero="auto"``, and with the ZeRO mode its entry was priced with,
``StageCost.zero_fallback``, where that search does not fit). Measured in ``docs/benchmarks.md`` (issue 29 item
6, the est29b section): with the carries of section 2 (``H``, ``K``) GPT-6.7B's estimated table chooses the exact
table's stages, ``[0,10)@4x1 rc-sel [10,18)@4x1 rc-sel [18,36)@8x1``, 44.44 s once planned (0.999 of the exact
table's; 4.4 % over before), and 1.3B and 2.6B are unchanged; GPT-39B's plan became 12 stages, 80.92 s once
planned. The exact table re-run after the same change (est29c section) plans 82.21 s (its first choice no longer
fits once planned): the estimate is 0.984 of it, 15B 0.989, every GPT row within 1 % or faster. It is the
default of ``meshpilot plan`` (``--table exact`` the table of section 2; ``plan_pipeline``'s own default stays the
exact table): GPT-39B's estimated table costs ~31 CPU s (est29d: 51 before its transposes, gap and DP changes), the
default command ~52 CPU s in all with its capture and final plans (the chosen stages' own searches ~12, in the
planning workers: ``Plan.with_intra(workers=)``), against ~330 for the exact table's; still far from the 10 s wall
issue 29 asks (docs/benchmarks.md, issue 29 item 6, def29).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import NamedTuple

import numpy as np
import torch

from meshpilot.cluster import CostModel, LogicalMesh
from meshpilot.cluster.mesh import mesh_shapes_2d
from meshpilot.graph.capture import OpGraph, capture
from meshpilot.planner.accounting import PhasePeaks
from meshpilot.planner.ilp import PlanError
from meshpilot.planner.parallel import map_columns, start_task
from meshpilot.planner.plan import MemoryUse, StepTime
from meshpilot.planner.recompute import Recompute
from meshpilot.planner.stage import Layer, StageCost, StageMemory, StagePlanner, range_keys, runnable_layers
from meshpilot.planner.zero import ZeroMode

MIN_BLOCKS = 4
"""Fewest blocks a repeated stack has: the first, two middle ones (one range of two), the last."""

KEEP = 4
"""Blocks :func:`capture_stack` traces (first, two middles, last)."""

MAX_LEVELS = 5
"""Most memory caps the block piece is planned under per logical mesh (module docstring, 2)."""

CAPPED_VARIANTS = 2
"""Most memory caps the variant table plans the block under per logical mesh, after its uncapped levels and only
for the ranges none of them fits (module docstring, 4; ``StackTable._capped_variants``)."""

LEVEL_KEYS = 16
"""Order keys per logical mesh (``j · LEVEL_KEYS + level``): more than either table's levels (the exact
table's recomputing candidates come after its :data:`MAX_LEVELS` cap levels)."""

PRICING_GAP = 1e-2
"""The relative MIP gap of the estimated table's capped block searches (module docstring, 5): they only price
entries, and the chosen stages are planned again at the searcher's own gap (``Plan.with_intra``)."""

RELAXED_PRICING = True
"""Whether the estimated table solves its pre and post pieces (embeddings; final norm and head) on every mesh from
their LP relaxation (module docstring, 5, *Relaxed pricing*; ``StackTable.relaxed``'s default): the chosen stages
are planned exactly all the same."""

FLOOR_MARGIN = 1e-9
"""Relative slack taken off a floor (``StagePlanner.floor``) before it is compared: the floor and a plan's
cost sum the same terms in other orders, so a floor as tight as the plan may exceed it by a rounding."""


class StageCosting(StrEnum):
    """How a pipeline plan's stages were costed."""

    EXACT = "exact"
    """Every range of layers searched as one slice (``pipeline._StageTable``)."""
    STACK = "repeated-block"
    """Composed from one block's plan and the special layers' (this module), the block under cap levels."""
    STACK_APPROX = "repeated-block variants"
    """Composed as :attr:`STACK` from the variant table's block plans: uncapped, ZeRO-sharded, recomputed (no
    capped search, module docstring, 4)."""
    STACK_ESTIMATED = "repeated-block estimated"
    """Chosen on the estimated table (module docstring, 5), the chosen stages composed as :attr:`STACK` from their
    own logical mesh's plans."""

    @classmethod
    def _missing_(cls, value: object) -> StageCosting | None:
        """Plans saved before the variant table name its costing "repeated-block approximate-then-exact"."""
        return cls.STACK_APPROX if value == "repeated-block approximate-then-exact" else None


class TableCosting(StrEnum):
    """Which block plans :class:`StackTable` composes its entries from (module docstring, 2 and 4)."""

    APPROXIMATE = "approximate"
    """The variant table: per logical mesh the block's uncapped plan, ZeRO-sharded and recomputed
    (:class:`ApproxLevel`), then capped only where none of those fits (``StackTable.refine``); every entry a plan
    (module docstring, 4)."""
    EXACT = "exact"
    """Per logical mesh, the block planned under up to :data:`MAX_LEVELS` memory caps (module docstring, 2)."""
    ESTIMATED = "estimated"
    """Per TP degree b the pieces planned once on ``(1, b)`` (and a two-server base), every logical mesh ``(a, b)``
    priced from them as replicas in closed form (:func:`_replicated`), a whole server's meshes searched under cap
    levels too; the chosen stages are planned on their own mesh (module docstring, 5)."""

    @property
    def stage_costing(self) -> StageCosting:
        """How a plan chosen on this table says its stages were costed."""
        return {TableCosting.APPROXIMATE: StageCosting.STACK_APPROX, TableCosting.EXACT: StageCosting.STACK,
                TableCosting.ESTIMATED: StageCosting.STACK_ESTIMATED}[self]  # fmt: skip


@dataclass(frozen=True)
class Stack:
    """A model of pre layers, L identical blocks and post layers, and the graph its pieces are planned on."""

    graph: OpGraph
    """The captured graph: all L blocks, or :attr:`kept` of them (:func:`capture_stack`)."""
    container: str
    pre: int
    blocks: int
    """L: the model's blocks."""
    kept: int
    """Blocks in :attr:`graph`."""
    post: int
    layers: tuple[Layer, ...]
    """The model's layers (``stage.layers`` of the whole model): those of :attr:`graph` when every block was
    captured, else the pre layers, the first block, a middle block repeated, the last block, the post layers
    (a repeated block lists no nodes: they are not in :attr:`graph`)."""

    @property
    def middle(self) -> int:
        """The graph layer of the middle block whose plan every block is priced by."""
        return self.pre + 1

    def parts(self, start: int, stop: int) -> tuple[tuple[int, int] | None, int, tuple[int, int] | None]:
        """Model layers ``[start, stop)`` as (pre part in graph layers or None, blocks, post part or None)."""
        p, L = self.pre, self.blocks
        pre = (start, min(stop, p)) if start < p else None
        k = max(0, min(stop, p + L) - max(start, p))
        off = self.kept - L
        post = (max(start, p + L) + off, stop + off) if stop > p + L else None
        return pre, k, post

    def graph_range(self, start: int, stop: int) -> tuple[int, int]:
        """Graph layers with the same ends as model layers ``[start, stop)``: what crosses into it is the
        same (the first / last block kept where the range has it, at most two blocks in between)."""
        p, L, m = self.pre, self.blocks, self.kept
        if m == L:
            return start, stop
        js, je = max(start, p) - p, min(stop, p + L) - p  # blocks [js, je)
        if je <= js:  # no block: pre or post only
            return (start, stop) if stop <= p else (start + m - L, stop + m - L)
        n = je - js
        if js == 0 and je == L:
            gs, ge = 0, m
        elif js == 0:
            gs, ge = 0, min(n, 2)
        elif je == L:
            gs, ge = m - min(n, 2), m
        else:
            gs, ge = 1, 1 + min(n, 2)
        a = start if start < p else p + gs
        b = stop + m - L if stop > p + L else p + ge
        return a, b

    def received(self, C: np.ndarray) -> np.ndarray:
        """``pipeline.received_bytes`` of the model's layers from that of the graph's (``C``)."""
        K = len(self.layers)
        if self.kept == self.blocks:
            return C
        out = np.zeros((K, K))
        for i in range(K):
            for k in range(i, K):
                a, b = self.graph_range(i, k + 1)
                out[i, k] = C[a, b - 1]
        return out


def _block_runs(all_layers: Sequence[Layer]) -> list[tuple[str, int, int]]:
    """Runs of consecutive layers ``c.0, c.1, …`` of one container: (c, first layer, count)."""
    runs: list[tuple[str, int, int]] = []
    for j, layer in enumerate(all_layers):
        head, _, idx = layer.name.rpartition(".")
        if not head or not idx.isdigit():
            continue
        if runs and runs[-1][0] == head and runs[-1][1] + runs[-1][2] == j and int(idx) == runs[-1][2]:
            runs[-1] = (head, runs[-1][1], runs[-1][2] + 1)
        elif int(idx) == 0:
            runs.append((head, j, 1))
    return runs


def find_stack(graph: OpGraph, all_layers: Sequence[Layer] | None = None, key=None) -> Stack | None:
    """The repeated stack of `graph` (module docstring, 1), or None when it has none of at least
    :data:`MIN_BLOCKS` blocks. `key` is ``stage.range_keys(graph, all_layers)`` when already made."""
    all_layers = tuple(all_layers) if all_layers is not None else tuple(runnable_layers(graph))
    runs = [r for r in _block_runs(all_layers) if r[2] >= MIN_BLOCKS]
    if not runs:
        return None
    c, p, L = max(runs, key=lambda r: r[2])
    key = key if key is not None else range_keys(graph, all_layers)
    mids = range(p + 1, p + L - 1)
    if len({key(j, j + 1) for j in mids}) != 1 or len({key(j, j + 2) for j in mids[:-1]}) != 1:
        return None
    return Stack(graph, c, p, L, L, len(all_layers) - p - L, all_layers)


def capture_stack(model: torch.nn.Module, inputs, *, keep: int = KEEP, **capture_kw) -> Stack | OpGraph:
    """Capture `model` with only `keep` blocks of its longest container of identical children, at any depth
    but inside no numbered child (module docstring, 1), and lay out the whole model's layers from them.
    Returns the :class:`Stack`, or the whole model's captured graph when it has no such container (or no more
    blocks than `keep`), or when the captured blocks are not a repeated stack. `capture_kw` goes to
    ``graph.capture.capture``."""

    def sig(m: torch.nn.Module) -> tuple:
        return type(m), tuple((k, tuple(v.shape), v.dtype) for k, v in m.state_dict(keep_vars=True).items())

    def whole() -> OpGraph:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return capture(model, inputs, **capture_kw)

    best = None
    for name, child in model.named_modules():  # nested too (a Hugging Face Llama's model.model.layers), not
        # inside a numbered child (a layer's experts)
        outer = bool(name) and not any(part.isdigit() for part in name.split("."))
        repeated = isinstance(child, torch.nn.ModuleList) and len(child) > keep and len({sig(b) for b in child}) == 1
        if outer and repeated and (best is None or len(child) > len(best[1])):
            best = (name, child)
    if best is None:
        return whole()
    name, full = best
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    setattr(parent, attr, torch.nn.ModuleList(list(full)[:keep]))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            graph = capture(model, inputs, **capture_kw)
    except Exception:  # noqa: BLE001 - a forward that needs all its blocks (it reads their count): the whole model
        graph = None
    finally:
        setattr(parent, attr, full)
    if graph is None:
        return whole()
    small = find_stack(graph)
    if small is None or small.container != name or small.blocks != keep:
        return whole()
    return expand_stack(small, len(full))


def expand_stack(small: Stack, blocks: int) -> Stack:
    """The :class:`Stack` of a model of `blocks` blocks from `small`, the stack of its capture with fewer
    (:func:`capture_stack`; a transform of that graph, e.g. ``planner.recompute.apply``, found again by
    :func:`find_stack`): the first block, a middle block repeated, the last block."""
    name, p, keep, gl = small.container, small.pre, small.blocks, small.layers
    out = [dataclasses.replace(gl[p], name=f"{name}.0")]
    out += [Layer(f"{name}.{j}", (), gl[p + 1].flops) for j in range(1, blocks - 1)]
    out += [dataclasses.replace(gl[p + keep - 1], name=f"{name}.{blocks - 1}")]
    model_layers = (*gl[:p], *out, *gl[p + keep :])
    return Stack(small.graph, name, p, blocks, keep, small.post, model_layers)


@dataclass
class _Piece:
    cost: StageCost
    mem: StageMemory
    inputs: float = 0.0
    """Of ``mem.static``, the input leaves ``I`` per device (the estimated table's catalogue: module docstring, 5)."""


@dataclass
class _Winners:
    """One column's entries so far: t_intra, candidate, order key; and the column's candidates."""

    t: np.ndarray
    arg: np.ndarray
    order: np.ndarray
    candidates: list
    unfit: dict = field(default_factory=dict)
    """The variant table's first pass, per logical mesh j with a range no uncapped plan fits: (its ``ok``
    accumulated, the block's uncapped plan, the captured graph's floors) for ``StackTable.refine``."""


@dataclass(frozen=True)
class _Ctx:
    """What every logical mesh of one column shares: the ranges' layout (``StackTable._layout``), the pieces
    used, which ranges may be stages, f(s) and the ranks."""

    PA: np.ndarray
    PB: np.ndarray
    NB: np.ndarray
    pres: list
    posts: list
    used_pre: set
    used_post: set
    use: np.ndarray
    f: np.ndarray
    ranks: range


class _CatalogueTask(NamedTuple):
    """One search of the estimated table's catalogue (:meth:`StackTable._plan_catalogue`): the graph of `mode`'s
    middle block, its graph `layer`, planned on the base mesh `base` under the device mappings `mappings` (None:
    every one). A tuple: hashable, and sent to the planning workers as it is."""

    base: tuple[int, int]
    mode: Recompute
    layer: int
    mappings: tuple | None = None


def _sum_time(parts: Sequence[tuple[StepTime, float]]) -> StepTime:
    return StepTime(*(sum(getattr(t, f.name) * w for t, w in parts) for f in dataclasses.fields(StepTime)))


@dataclass
class StackTable:
    """The fast stage table (module docstring, 2): ``t[s, k, i, z]`` like ``pipeline._StageTable.arrays``."""

    planner: StagePlanner
    stack: Stack
    bounds: tuple[tuple[int, int], ...]
    """Each cluster's model layers ``[start, stop)``."""
    sizes: tuple[int, ...]
    microbatches: int
    capacity: float
    max_stages: int
    useful: object
    """``(k, i, d) -> bool``: whether the range can be a stage (``pipeline._StageTable.useful``)."""
    in_flight: object
    """``s -> f(s)``: microbatches in flight of a stage with s stages from it to the end."""
    kw: dict = field(default_factory=dict)
    shapes: object = mesh_shapes_2d
    """``d -> [(a, b), ...]``: the logical shapes costed per submesh size (``pipeline.logical_shapes``)."""
    candidates: list[Candidate] = field(default_factory=list)
    """Each candidate's size, shape and block plan; ``arrays``' ``arg`` indexes it."""
    workers: int = 1
    """Processes the columns are computed in (``planner.parallel``)."""
    prune: bool = True
    """Skip the logical meshes and cap levels whose floors show they cannot change an entry (module
    docstring, 3: the same table); False searches every one (for the tests)."""
    costing: TableCosting = TableCosting.EXACT
    """The block plans the entries are composed from (:class:`TableCosting`)."""
    accumulated: bool = True
    """Count the gradients summed over the microbatches in the forward + backward peak (``StageMemory.accumulated``),
    as ``auto.plan`` — and so ``Plan.with_intra`` — does; False leaves them out (the tables before they were
    counted, for comparisons)."""
    relaxed: bool = RELAXED_PRICING
    """The estimated table's pre and post pieces solved from their LP relaxation (``ilp.solve(relaxed=)``; module
    docstring, 5, *Relaxed pricing*); False: by the whole ILP. No other table reads it."""
    _first: list = field(default_factory=list, init=False, repr=False)
    """The variant table's first pass, per column: ``_column``'s answer, which :meth:`refine` goes on from."""
    _server_caps: dict = field(default_factory=dict, init=False, repr=False)
    """The estimated table's server columns whose cap levels are searched in a process of their own (module
    docstring, 5; :meth:`_estimated_arrays`, which merges them after the column's replicas): their keys z."""
    _catalogue: dict = field(default_factory=dict, init=False, repr=False)
    """The estimated table's pieces per base mesh (module docstring, 5): ``(a0, b) -> {recompute: (pre pieces,
    post pieces, block)}``, planned by the workers before the columns are priced."""
    recomputed: dict[Recompute, tuple[StagePlanner, Stack]] = field(default_factory=dict)
    """Per recomputation, the planner and stack of the graph with every captured block recomputed so
    (``config_plan.recomputed_stack``): the recomputing levels either table may offer (module docstring, 2 and
    4); empty: none."""

    def _piece(
        self,
        rng: tuple[int, int],
        ranks,
        shape,
        cap: float,
        zero: ZeroMode | None = None,
        planner=None,
        gap=None,
        mappings: tuple | None = None,
        relaxed: bool = False,
    ) -> _Piece | None:
        kw = dict(self.kw)
        if mappings:
            kw["mappings"] = mappings
        kw["capacity"] = cap
        if zero is not None:
            kw["zero"] = zero
        if gap is not None:
            kw["mip_gap"] = gap
        if relaxed:
            kw["relaxed"] = True
        planner = planner or self.planner
        try:
            c, m = planner.plan_with_memory(rng[0], rng[1], ranks, shape, microbatches=self.microbatches, **kw)
        except PlanError:
            return None
        return _Piece(c, m)

    def _layout(self):
        """Per cluster range (k, i): its pre part, blocks and post part, as index arrays."""
        L = len(self.bounds)
        st = self.stack
        pre_ids: dict[tuple[int, int] | None, int] = {None: 0}
        post_ids: dict[tuple[int, int] | None, int] = {None: 0}
        PA = np.zeros((L, L), dtype=np.int64)
        PB = np.zeros((L, L), dtype=np.int64)
        NB = np.zeros((L, L))
        for k in range(L):
            for i in range(k, L):
                pre, nb, post = st.parts(self.bounds[k][0], self.bounds[i][1])
                PA[k, i] = pre_ids.setdefault(pre, len(pre_ids))
                PB[k, i] = post_ids.setdefault(post, len(post_ids))
                NB[k, i] = nb
        return PA, PB, NB, list(pre_ids), list(post_ids)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``t[s, k, i, z]`` (t_intra: ∞ where nothing fits) and ``arg[s, k, i, z]`` (into :attr:`candidates`),
        planning the pieces as it goes (module docstring, 2 and 3): a column per submesh size, in
        :attr:`workers` processes (``planner.parallel``: the same table as one after the other)."""
        layout = self._layout()
        f = np.array([self.in_flight(s) for s in range(1, self.max_stages + 1)], dtype=float)
        if self.costing == TableCosting.ESTIMATED:
            return self._estimated_arrays(layout, f)
        self._first = map_columns(
            functools.partial(self._column, layout, f), range(len(self.sizes)), self.planner, self.workers
        )
        return self._joined([c[:3] for c in self._first])

    def _estimated_arrays(self, layout, f: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`arrays` of the estimated table (module docstring, 5): with several workers the server column's
        cap levels (its longest serial piece) start first in a process of their own (``parallel.start_task``),
        on empty winners, while the catalogue and then every column (the server column's replicas too) are
        searched over the other workers; the cap levels are merged after that column's replicas
        (:func:`_merge_after`, what :meth:`_offer` keeps). One worker: the cap levels in the column, after its
        replicas and pruned against them."""
        server_z = [z for z, d in enumerate(self.sizes) if d == self._server()]
        caps = None
        if self.workers > 1 and server_z:
            caps = start_task(functools.partial(self._server_caps_alone, layout, f), server_z, self.planner)
        workers = self.workers - 1 if caps is not None else self.workers
        self._server_caps = dict.fromkeys(server_z) if caps is not None else {}  # their levels: merged below
        try:
            self._plan_catalogue(workers)
            columns = map_columns(
                functools.partial(self._column, layout, f), range(len(self.sizes)), self.planner, workers
            )
        except BaseException:
            if caps is not None:
                caps.abandon()
            raise
        if caps is not None:
            for z, won in zip(server_z, caps.result()):
                win = columns[z][3]
                if win is None:  # no range useful on that size: no level searched either
                    continue
                _merge_after(win, won)
                columns[z] = (win.t, win.arg, win.candidates, None)
        self._first = columns
        return self._joined([c[:3] for c in columns])

    def _joined(self, columns: list[tuple[np.ndarray, np.ndarray, list]]) -> tuple[np.ndarray, np.ndarray]:
        """The table's ``t`` and ``arg`` from its columns ``(t[1:, :, :, z], arg into the column's candidates,
        those candidates)``, the candidates appended to :attr:`candidates` (``arg`` indexes those)."""
        L, Z, S = len(self.bounds), len(self.sizes), self.max_stages
        t = np.full((S + 1, L, L, Z), math.inf)
        arg = np.full((S + 1, L, L, Z), -1, dtype=np.int64)
        for z, (tz, az, cands) in enumerate(columns):
            t[1:, :, :, z] = tz
            arg[1:, :, :, z] = np.where(az >= 0, az + len(self.candidates), -1)
            self.candidates += cands
        return t, arg

    def _column(self, layout, f: np.ndarray, z: int) -> tuple[np.ndarray, np.ndarray, list, tuple | None]:
        """Size z's column: ``t[1:, :, :, z]``, ``arg`` into the candidates it returns (module docstring, 2 and
        3), and for the variant table what :meth:`refine` goes on from (its winners, context and shapes)."""
        ctx, win, shapes = self._column_start(layout, f, z)
        tz, az, candidates = win.t, win.arg, win.candidates
        if not ctx.use.any():
            return tz, az, candidates, None
        PA, PB, NB, pres, posts = layout
        ranks, used_pre, used_post, use = ctx.ranks, ctx.used_pre, ctx.used_post, ctx.use
        if self.costing == TableCosting.ESTIMATED:  # every mesh priced from the catalogue
            for j, shape in enumerate(shapes):
                self._estimated_levels(ctx, win, j, shape)
            if z in self._server_caps:  # searched in a process of their own: merged after (_estimated_arrays)
                return tz, az, candidates, win
            if self.sizes[z] == self._server():  # a whole server's meshes: their cap levels too (docstring, 5)
                self._server_cap_levels(ctx, win, shapes)
            return tz, az, candidates, None
        floors = [self._floors(pres, posts, used_pre, used_post, ranks, shape) if self.prune else None
                  for shape in shapes]  # fmt: skip
        # the winner of each entry is the least (t, order) of the candidates, order = (shape's place in
        # `shapes`, level): what searching in that order and keeping strict improvements gives
        for j in sorted(range(len(shapes)), key=lambda j: (floors[j][2].time_s if self.prune else 0.0, j)):
            lower = self._lower(floors[j], PA, PB, NB, f, use) if self.prune else None
            if lower is not None and not self._can_improve(lower, tz, win.order, j * LEVEL_KEYS):
                continue
            if self.costing == TableCosting.APPROXIMATE:
                self._variant_levels(ctx, win, j, shapes[j], floors[j])
                continue
            self._cap_levels(ctx, win, j, shapes[j], lower)
            if self.recomputed:  # then the recomputing blocks, where their floors may change an entry
                self._variant_levels(ctx, win, j, shapes[j], floors[j], RECOMPUTING, MAX_LEVELS)
        return tz, az, candidates, (win, ctx, shapes) if self.costing == TableCosting.APPROXIMATE else None

    def _column_start(self, layout, f: np.ndarray, z: int) -> tuple[_Ctx, _Winners, list]:
        """Size z's column before any candidate: what its meshes share, its empty winners and its shapes."""
        L, S = len(self.bounds), self.max_stages
        PA, PB, NB, pres, posts = layout
        d = self.sizes[z]
        use = np.zeros((L, L), dtype=bool)
        for k in range(L):
            for i in range(k, L):
                use[k, i] = self.useful(k, i, d)
        used_pre, used_post = set(PA[use].tolist()), set(PB[use].tolist())
        win = _Winners(
            np.full((S, L, L), math.inf), np.full((S, L, L), -1, dtype=np.int64),
            np.full((S, L, L), np.iinfo(np.int64).max, dtype=np.int64), [],
        )  # fmt: skip
        ctx = _Ctx(PA, PB, NB, pres, posts, used_pre, used_post, use, f, range(d))
        return ctx, win, list(self.shapes(d))

    def _offer(self, ctx: _Ctx, win: _Winners, key: int, specials, blk: _Piece | None, c: Candidate) -> np.ndarray:
        """Compose `blk` and `specials` over every range, keep each entry's least (t, order) in `win`; returns
        ``ok[s, k, i]``: which entries this candidate fits (Eq. 5)."""
        T, fb, upd, act = _compose(specials, blk, ctx.PA, ctx.PB, ctx.NB)
        if self.counts_accumulated:  # the summed gradients, as ``auto.plan`` counts them
            fb = fb + _accumulated(specials, blk, ctx.PA, ctx.PB, ctx.NB)
        T = np.where(ctx.use, T, math.inf)
        win.candidates.append(c)
        cid = len(win.candidates) - 1
        f = ctx.f
        mem = np.maximum(upd[None], fb[None] + (f[:, None, None] - 1) * act[None])
        ok = (mem <= self.capacity) & np.isfinite(T)[None]
        cand = np.where(ok, T[None] / self.microbatches, math.inf)
        better = (cand < win.t) | ((cand == win.t) & np.isfinite(cand) & (key < win.order))
        win.t[better] = cand[better]
        win.arg[better] = cid
        win.order[better] = key
        return ok

    def _server_cap_levels(self, ctx: _Ctx, win: _Winners, shapes: Sequence[tuple[int, int]]) -> None:
        """The estimated table's searches of a whole server's logical meshes (module docstring, 5): each mesh's cap
        levels as the exact table's (:meth:`_cap_levels`), after its replicas were offered, where its floors show
        a plan of it may change an entry (module docstring, 3). Of a mesh ``(a, b)`` and its transpose ``(b, a)``
        only the first in `shapes` is searched (module docstring, 5: one server's two orientations are the same
        search up to which axis is which)."""
        for j, shape in enumerate(shapes):
            if _transposed_earlier(shape, shapes[:j]):
                continue
            floors = self._floors(ctx.pres, ctx.posts, ctx.used_pre, ctx.used_post, ctx.ranks, shape)
            lower = self._lower(floors, ctx.PA, ctx.PB, ctx.NB, ctx.f, ctx.use)
            if self._can_improve(lower, win.t, win.order, j * LEVEL_KEYS):
                self._cap_levels(ctx, win, j, shape, lower)

    def _cap_levels(self, ctx: _Ctx, win: _Winners, j: int, shape, lower) -> None:
        """The exact table's candidates of logical mesh `shape` (the j-th): the block under up to
        :data:`MAX_LEVELS` memory caps, none past the level aimed at the largest range still unfitted (module
        docstring, 2)."""
        mid, d = self.stack.middle, len(ctx.ranks)
        specials = self._both_specials(ctx, shape)
        blocks_needed = ctx.use & (ctx.NB > 0)
        block_cap, target = self.capacity, 0
        for level in range(MAX_LEVELS):
            key = j * LEVEL_KEYS + level
            if level and lower is not None and not self._can_improve(lower, win.t, win.order, key):
                break  # no plan of this mesh under any cap can change an entry (module docstring, 3)
            # the estimated table prices its capped blocks at a looser gap (module docstring, 5)
            gap = PRICING_GAP if level and self.costing == TableCosting.ESTIMATED else None
            blk = self._piece((mid, mid + 1), ctx.ranks, shape, block_cap, gap=gap)
            ok = self._offer(ctx, win, key, specials, blk, Candidate(d, shape, block_cap, block_gap=gap))
            # a tighter cap only where some range of blocks fits with no number of stages after it
            fitless = blocks_needed & ~ok.any(axis=0)
            if blk is None or not fitless.any() or target >= ctx.NB[fitless].max():
                break  # the last: aimed at as many blocks as the largest range still unfitted, or more
            target, block_cap = self._next_cap(ctx, fitless, target, block_cap, blk)

    def _next_cap(
        self, ctx: _Ctx, fitless: np.ndarray, target: int, block_cap: float, blk: _Piece
    ) -> tuple[int, float]:
        """The next cap level's (blocks aimed at, cap) after a level aimed at `target` blocks under `block_cap`
        whose plan is `blk` (module docstring, 2): the fewest blocks of a range still without a fit (`fitless`)
        and at least twice `target`, the cap ``_cap_for`` those blocks of `blk` and at most 0.9 of `block_cap`."""
        target = max(int(ctx.NB[fitless].min()), 2 * target)
        return target, min(0.9 * block_cap, _cap_for(blk.mem, target, self.capacity, self.counts_accumulated))

    def _variant_levels(
        self,
        ctx: _Ctx,
        win: _Winners,
        j: int,
        shape,
        floors,
        levels: Sequence[ApproxLevel] | None = None,
        key0: int = 0,
    ) -> None:
        """The variant table's candidates of logical mesh `shape` (the j-th; module docstring, 4): the block's
        uncapped plan, its ZeRO-sharded answers, then the same on each recomputing graph, each while some
        useful entry with blocks does not fit yet. `levels` (keys from `key0`): the exact table offers
        :data:`RECOMPUTING` after its cap levels. `floors`: the captured graph's (``_floors``; None: not
        pruned); a recomputing block has its own (it saves less), its pre and post pieces are the captured
        ones (recomputation copies blocks only), planned once for every level."""
        blocks_needed = (ctx.use & (ctx.NB > 0))[None]
        specials = self._both_specials(ctx, shape)
        floored, lower = None, None  # the graph whose floors `lower` is made of
        fits, full, captured_lower = np.zeros(ctx.f.shape + ctx.NB.shape, dtype=bool), None, None
        for level in tuple(ApproxLevel) if levels is None else levels:
            key = j * LEVEL_KEYS + key0 + int(level)
            mode = level.recompute
            if mode is not Recompute.NONE and mode not in self.recomputed:
                continue
            planner, stack = self._graph_of(mode)
            mid = stack.middle
            if mode is not floored:
                floored = mode
                if floors is not None:
                    blk = floors[2]  # a recomputing block saves less: its own floor
                    if mode is not Recompute.NONE:
                        blk = self._floor(planner, (mid, mid + 1), ctx.ranks, shape)
                    lower = self._lower((floors[0], floors[1], blk), ctx.PA, ctx.PB, ctx.NB, ctx.f, ctx.use)
                    captured_lower = lower if mode is Recompute.NONE else captured_lower
            if (key0 or level) and lower is not None and not self._can_improve(lower, win.t, win.order, key):
                continue  # this graph's floors show no plan of it changes an entry
            blk = self._piece((mid, mid + 1), ctx.ranks, shape, self.capacity, level.zero, planner)
            c = Candidate(len(ctx.ranks), shape, self.capacity, level.zero, mode)
            ok = self._offer(ctx, win, key, specials, blk, c)
            fits |= ok
            full = blk if level is ApproxLevel.FULL else full
            if blk is not None and not (blocks_needed & ~ok).any():
                return
        if levels is None and full is not None:  # the variant table: what no uncapped plan fit, for `refine`
            win.unfit[j] = (fits, full, captured_lower)

    def _server(self) -> int:
        cl = self.planner.cluster
        return cl.layers[-1].ranks if cl.layers else 1

    def _plan_catalogue(self, workers: int) -> None:
        """The estimated table's catalogue (module docstring, 5): for every TP degree b of a server's GPUs that
        some logical mesh ``(a, b)`` of the table has, each graph's middle block planned on ``(1, b)`` at the
        device's capacity, and where the table has meshes across servers on ``(2 · server / b, b)`` too (two
        servers), in `workers` processes."""
        server = self._server()
        tps = sorted({b for d in self.sizes for _, b in self.shapes(d) if server % b == 0})
        bases = [(1, b) for b in tps]
        if max(self.sizes) >= 2 * server:
            bases += [(2 * server // b, b) for b in tps]
        modes = [Recompute.NONE, *self.recomputed]
        # every search of the catalogue once, spread over the planning workers (``planner.parallel``: what they
        # search is merged into each graph's planner, so composing a chosen stage on a base searches nothing again);
        # a recomputing block across servers after the captured one, on the device mapping that one chose there
        tasks = [_CatalogueTask(base, mode, self._graph_of(mode)[1].middle) for base in bases for mode in modes]
        first = [t for t in tasks if t.mode is Recompute.NONE or t.base[0] == 1]
        planners = [self._graph_of(mode)[0] for mode in modes]
        found = dict(zip(first, map_columns(self._catalogue_piece, first, planners, workers)))
        chose = {t.base: (x.cost.mapping,) for t, x in found.items() if t.mode is Recompute.NONE and x is not None}
        later = [t._replace(mappings=chose.get(t.base)) for t in tasks if t not in found]
        found.update(
            (t._replace(mappings=None), x)
            for t, x in zip(later, map_columns(self._catalogue_piece, later, planners, workers))
        )
        for base in bases:
            self._catalogue[base] = {t.mode: found[t] for t in tasks if t.base == base}

    def _server_caps_alone(self, layout, f: np.ndarray, server_z: Sequence[int]) -> list[_Winners]:
        """Each server column z's cap levels (:meth:`_server_cap_levels`) on empty winners: what
        :meth:`_estimated_arrays` merges after the column's replicas (:func:`_merge_after`). Searched beside the
        catalogue and the other columns, as the table's longest serial part (GPT-39B on alpa-p3x8: ~12 of its
        table's ~25 CPU s, the catalogue ~7, the columns ~6), it prunes against no replica: it may search levels
        the replicas would have pruned, which cannot win (module docstring, 3), so the merged column is the one
        searched after the replicas."""
        won = []
        for z in server_z:
            ctx, win, shapes = self._column_start(layout, f, z)
            if ctx.use.any():
                self._server_cap_levels(ctx, win, shapes)
            won.append(win)
        return won

    def _catalogue_piece(self, task: _CatalogueTask) -> _Piece | None:
        """One search of the catalogue: `task`'s block planned on its base mesh."""
        return self._listed(self._graph_of(task.mode)[0], (task.layer, task.layer + 1), task.base, task.mappings)

    def _listed(self, planner: StagePlanner, rng: tuple[int, int], base: tuple[int, int], maps=None) -> _Piece | None:
        """Layers `rng` of `planner`'s graph planned on mesh `base` (device mappings `maps`, None: every one) for the
        catalogue, with their input leaves' bytes per device: the slice's inputs split over its devices (the plans at
        the device's capacity split the rows, module docstring, 5)."""
        n = base[0] * base[1]
        x = self._piece(rng, range(n), base, self.capacity, planner=planner, mappings=maps)
        if x is not None:
            sub = planner._slice(rng[0], rng[1])[0]
            x.inputs = sum(float(info.nbytes) for info in sub.input_infos) / n
        return x

    def _estimated_levels(self, ctx: _Ctx, win: _Winners, j: int, shape) -> None:
        """The estimated table's candidates of logical mesh ``shape = (a, b)`` (the j-th; module docstring, 5):
        for each :class:`ApproxLevel` its catalogue block of ``(a0, b)`` — ``(1, b)`` within a server, the
        two-server base across servers — replicated over ``a / a0`` (:func:`_replicated`: ZeRO-3 for the ZeRO
        levels), with the pre and post pieces searched on ``shape`` itself (``_both_specials``, as the exact table
        and :meth:`stage_cost` plan them), offered as every other table offers its plans. A mesh with no such
        base, or whose a does not divide the microbatch's rows, is not priced."""
        a, b = shape
        rows = min((int(x.shape[0]) for x in self.stack.graph.input_infos if len(x.shape)), default=1)
        a0 = 1 if a * b <= self._server() else 2 * self._server() // b
        base = (a0, b)
        if base not in self._catalogue or rows % a or a % a0:
            return
        r = a // a0
        mesh = LogicalMesh(self.planner.cluster, tuple(shape), np.arange(a * b).reshape(shape))
        cm = CostModel(mesh)
        specials = None  # searched once a level needs them
        for level in ApproxLevel:
            mode = level.recompute
            if mode not in self._catalogue[base] or (r == 1 and level.zero is not None):
                continue  # ZeRO over one replica is the plan itself
            blk = self._catalogue[base][mode]
            specials = self._both_specials(ctx, shape) if specials is None else specials
            one = None if blk is None else _replicated(blk, r, cm, level.zero is not None, self.microbatches)
            c = Candidate(len(ctx.ranks), tuple(shape), self.capacity, level.zero, mode)
            self._offer(ctx, win, j * LEVEL_KEYS + int(level), specials, one, c)

    def refine(self, bound: float) -> tuple[np.ndarray, np.ndarray]:
        """The variant table's second pass (module docstring, 4): :meth:`arrays` again with each logical mesh's
        capped block plans added (``_capped_variants``) where the uncapped ones left a range of blocks without
        a fit, and only where their floors may beat `bound` — ``step / B`` of the plan the DP found on the first
        pass: a plan of Eq. 2's step ``Σ t + (B − 1) · max t ≥ B · max t`` beats it only with every stage's
        t_intra below that. Call after :meth:`arrays` on the same table."""
        self.candidates = []
        z = range(len(self.sizes))
        return self._joined(map_columns(functools.partial(self._capped_column, bound), z, self.planner, self.workers))

    def _capped_column(self, bound: float, z: int) -> tuple[np.ndarray, np.ndarray, list]:
        """Size z's column of :meth:`refine`: the first pass' column with the capped variants offered."""
        tz, az, cands, state = self._first[z]
        if state is None or not state[0].unfit:
            return tz, az, cands
        first, ctx, shapes = state
        win = _Winners(tz.copy(), az.copy(), first.order.copy(), list(cands))
        for j, (fits, full, lower) in first.unfit.items():
            specials = self._both_specials(ctx, shapes[j])
            self._capped_variants(ctx, win, j, shapes[j], specials, full, fits, lower, bound)
        return win.t, win.arg, win.candidates

    def _capped_variants(
        self, ctx: _Ctx, win: _Winners, j: int, shape, specials, full: _Piece, fits: np.ndarray, lower, bound: float
    ) -> None:
        """The variant table's last candidates of logical mesh `shape` (module docstring, 4): the captured block
        searched under up to :data:`CAPPED_VARIANTS` memory caps, each derived from the ranges of blocks that
        no candidate of this mesh fits with any number of stages after them (`fits`: ``ok[s, k, i]`` of its
        uncapped ones) and whose floors may beat `bound` (t_intra) — the cap at which the fewest blocks of such
        a range fit (``_cap_for`` of the previous block plan, `full` first), at least twice the previous
        level's blocks, as the exact table's cap levels choose theirs. `lower`: the captured graph's floors
        (``_lower``; None: not pruned, every range kept)."""
        mid, d = self.stack.middle, len(ctx.ranks)
        # a capped block is no faster than the uncapped one: its stages' t_intra are at least the uncapped ones'
        uncapped = _compose(specials, full, ctx.PA, ctx.PB, ctx.NB)[0] / self.microbatches
        if lower is None:
            lower = (np.zeros_like(uncapped), np.broadcast_to(ctx.use, fits.shape))
        lower = (np.maximum(lower[0], uncapped), lower[1])
        relevant = ctx.use & (ctx.NB > 0) & (lower[1] & (lower[0] < bound)[None]).any(axis=0)
        block_cap, target, blk = self.capacity, 0, full
        for n in range(CAPPED_VARIANTS):
            fitless = relevant & ~fits.any(axis=0)
            key = j * LEVEL_KEYS + len(ApproxLevel) + n
            below = np.minimum(win.t, bound)  # an entry at the bound or above cannot improve the plan
            if not fitless.any() or not self._can_improve(lower, below, win.order, key):
                return
            target, block_cap = self._next_cap(ctx, fitless, target, block_cap, blk)
            blk = self._piece((mid, mid + 1), ctx.ranks, shape, block_cap)
            if blk is None:  # a cap the block's ILP cannot meet: tighter ones cannot either
                return
            fits |= self._offer(ctx, win, key, specials, blk, Candidate(d, shape, block_cap))

    @property
    def counts_accumulated(self) -> bool:
        """Whether the entries count the gradients summed over the microbatches (:attr:`accumulated`)."""
        return self.accumulated

    def _graph_of(self, recompute: Recompute) -> tuple[StagePlanner, Stack]:
        """The planner and stack of the captured graph, or of its recomputing copy (:attr:`recomputed`)."""
        return (self.planner, self.stack) if recompute is Recompute.NONE else self.recomputed[recompute]

    def _both_specials(self, ctx: _Ctx, shape) -> list:
        """The pre and the post pieces on `shape` (the captured graph's: recomputation copies blocks only)."""
        return [
            self._specials(ctx.pres, ctx.ranks, shape, ctx.used_pre),
            self._specials(ctx.posts, ctx.ranks, shape, ctx.used_post),
        ]

    @property
    def _relaxes(self) -> bool:
        """Whether this table solves its pre and post pieces from their relaxation (:attr:`relaxed`)."""
        return self.relaxed and self.costing == TableCosting.ESTIMATED

    def _specials(self, ranges, ranks, shape, used) -> list[_Piece | None]:
        """The pre (or post) pieces on `shape`, planned for the ids in `used` (those some range useful on this
        size has) only: the others' ranges are ∞ in ``arrays`` whatever they cost."""
        cap, relaxed = self.capacity, self._relaxes
        return [None] + [self._piece(r, ranks, shape, cap, relaxed=relaxed) if j in used else None
                         for j, r in enumerate(ranges[1:], 1)]  # fmt: skip

    def _floors(self, pres, posts, used_pre, used_post, ranks, shape):
        """``StagePlanner.floor`` of the used pre pieces, the used post pieces (by id; None unused) and the
        middle block on `shape`."""
        pre = [None] + [self._floor(self.planner, r, ranks, shape) if j in used_pre else None
                        for j, r in enumerate(pres[1:], 1)]  # fmt: skip
        post = [None] + [self._floor(self.planner, r, ranks, shape) if j in used_post else None
                         for j, r in enumerate(posts[1:], 1)]  # fmt: skip
        mid = self.stack.middle
        return pre, post, self._floor(self.planner, (mid, mid + 1), ranks, shape)

    def _floor(self, planner: StagePlanner, rng: tuple[int, int], ranks, shape):
        """``StagePlanner.floor`` of layers `rng` of `planner`'s graph on `shape` (the table's forced layouts)."""
        kw = {k: v for k, v in self.kw.items() if k == "force"}
        return planner.floor(rng[0], rng[1], ranks, shape, microbatches=self.microbatches, **kw)

    def _lower(self, floors, PA, PB, NB, f, use) -> tuple[np.ndarray, np.ndarray]:
        """Per cluster range, what no candidate of one logical mesh (any cap) can beat (module docstring, 3):
        ``t[k, i]``, a lower bound of its t_intra, and ``fit[s, k, i]``, whether it may fit with s stages
        from it to the end (its memory floor within the capacity); ranges not useful: no fit."""
        pre, post, blk = floors

        def cols(xs) -> np.ndarray:  # [id, (time, update, backward, saved)]; absent pieces count 0
            return np.array([[0.0] * 4 if x is None else [x.time_s, x.update, x.backward, x.saved] for x in xs])

        P, Q = cols(pre)[PA], cols(post)[PB]
        b = np.array([blk.time_s, blk.update, blk.backward, blk.saved])
        lo = P + Q + NB[..., None] * b
        margin = 1 - FLOOR_MARGIN
        t_low = lo[..., 0] * margin / self.microbatches
        need = np.maximum(lo[None, ..., 1], lo[None, ..., 2] + (f[:, None, None] - 1) * lo[None, ..., 3]) * margin
        return t_low, (need <= self.capacity) & use[None]

    @staticmethod
    def _can_improve(lower, t, order, key: int) -> bool:
        """Whether a candidate of order `key` whose every entry is at least ``lower`` (``_lower``) could win
        some entry of ``t`` (the current winners, of order ``order``): beat it, or tie it and come first."""
        t_low, fit = lower
        return bool((fit & ((t_low[None] < t) | ((t_low[None] == t) & (key < order)))).any())

    def stage_cost(self, start: int, stop: int, ranks: Sequence[int], cand: int) -> StageCost:
        """The stage of model layers ``[start, stop)`` composed on `ranks` as candidate `cand` (its shape and
        block plan) of :meth:`arrays`."""
        c = self.candidates[cand]
        kw = {k: v for k, v in self.kw.items() if k != "capacity"}
        planner, stack = self._graph_of(c.recompute)
        cost = compose_stage(
            planner, stack, start, stop, ranks, c.shape, microbatches=self.microbatches, ends=self.planner,
            capacity=self.capacity, block_capacity=c.block_cap, block_zero=c.block_zero, recompute=c.recompute,
            accumulated=self.counts_accumulated, block_gap=c.block_gap, **kw,
        )  # fmt: skip
        if self.costing == TableCosting.ESTIMATED:  # its ZeRO level priced the memory; the stage's own search
            # chooses its ZeRO, that level where the choice does not fit (module docstring, 5)
            cost = dataclasses.replace(cost, zero=None, zero_fallback=cost.zero)
        return cost


class ApproxLevel(IntEnum):
    """The variant table's block plans per logical mesh, in the order tried (module docstring, 4): one uncapped
    search of the captured block and one of each recomputing block (selective regions, then whole), each also
    with the ZeRO post-pass forced at stage 3 — every one a plan, none estimated. (ZeRO stage 2 is left out: the
    pipeline runtime gathers ZeRO weights where they are read, ``validate``.) The exact table offers the
    recomputing ones after its cap levels (:data:`RECOMPUTING`)."""

    FULL = 0
    """The block searched at the device's capacity (its ZeRO post-pass the table's own)."""
    ZERO = 1
    """The same answer with every replicated update ZeRO-sharded at stage 3 (``zero.ZeroMode.STAGE3``)."""
    SELECTIVE = 2
    """The block of the selectively recomputing graph (``StackTable.recomputed``) searched at the device's
    capacity: its matrix products' and attention's outputs kept, the rest run again."""
    SELECTIVE_ZERO = 3
    """:attr:`SELECTIVE`'s answer with ZeRO stage 3 forced."""
    RECOMPUTE = 4
    """The block of the wholly recomputing graph searched at the device's capacity."""
    RECOMPUTE_ZERO = 5
    """:attr:`RECOMPUTE`'s answer with ZeRO stage 3 forced."""

    @property
    def zero(self) -> ZeroMode | None:
        """The ZeRO mode forced on the block's plan (None: the table's own)."""
        zeroed = (ApproxLevel.ZERO, ApproxLevel.SELECTIVE_ZERO, ApproxLevel.RECOMPUTE_ZERO)
        return ZeroMode.STAGE3 if self in zeroed else None

    @property
    def recompute(self) -> Recompute:
        """Which recomputing graph the block is of (NONE: the captured one)."""
        if self >= ApproxLevel.RECOMPUTE:
            return Recompute.FULL
        return Recompute.SELECTIVE if self >= ApproxLevel.SELECTIVE else Recompute.NONE


RECOMPUTING = tuple(level for level in ApproxLevel if level.recompute is not Recompute.NONE)
"""The variant levels on recomputing graphs: what the exact table offers after its cap levels."""


@dataclass(frozen=True)
class Candidate:
    """One logical mesh's block plan in :class:`StackTable`: what its entries were composed from."""

    size: int
    shape: tuple[int, int]
    block_cap: float
    """The block's memory cap."""
    block_zero: ZeroMode | None = None
    """The block's ZeRO post-pass (None: the table's own, ``zero.ZeroMode.AUTO`` by default)."""
    recompute: Recompute = Recompute.NONE
    """Composed from that recomputing graph (:attr:`StackTable.recomputed`): every block of the stage recomputed
    so."""
    block_gap: float | None = None
    """The block's MIP gap (None: the searcher's; :data:`PRICING_GAP`: an estimated table's capped block)."""


def _merge_after(win: _Winners, later: _Winners) -> None:
    """`later`'s candidates offered after `win`'s, kept where ``StackTable._offer`` would have kept them: a
    strictly smaller t, or the same t and a smaller order key (an equal key: the earlier, `win`'s)."""
    off = len(win.candidates)
    better = (later.t < win.t) | ((later.t == win.t) & np.isfinite(later.t) & (later.order < win.order))
    win.t[better] = later.t[better]
    win.arg[better] = later.arg[better] + off
    win.order[better] = later.order[better]
    win.candidates += later.candidates


def _replicated(x: _Piece, a: int, cm: CostModel, zero: bool, B: int) -> _Piece:
    """Piece `x`, planned on a base mesh ``(a0, b)``, as `a` replicas of it on ``(a · a0, b)`` (module docstring,
    5; `cm` that mesh's cost model): each replica computes ``1/a`` of the microbatch's rows, so compute, the
    base's collectives, resharding, saved values and the live values beyond the gradients scale by ``1/a``; the
    gradients (the weights' bytes ``w``: the same dtype and sharding) are all-reduced over axis 0 once a step.
    With `zero` (ZeRO-3 over axis 0) the state, the gradients, the update's temporaries and the optimizer step
    are ``1/a`` of the replica's, the weights all-gathered once a microbatch (the copy kept for its backward, as
    ``zero``'s stage 3 prices it) and the gradients reduce-scattered once a step, and the live peak holds that
    gathered copy ``w`` besides the replica's share."""
    if a == 1:
        return x
    t, m = x.cost.time, x.mem
    w = m.grads
    acts = max(m.live_peak - w, 0.0) / a
    if zero:
        once = cm.reduce_scatter(w, 0)
        sync = once + B * cm.all_gather(w, 0)
        time_ = StepTime(t.compute_s / a, t.communication_s / a + sync, t.resharding_s / a, t.optimizer_s / a)
        # carried to the backward: the weights it reads through saved views, gathered (``liveness`` keeps the copy);
        # the gradients as produced: the replica's partial sums, whole (the reduce-scatter's input)
        mem = StageMemory(m.static / a, w / a, m.update_temp / a, m.saved / a, acts + w / a + w, m.accumulated,
                          read_back=m.read_back, saved_held=m.read_back, grads_held=m.grads_held)  # fmt: skip
    else:
        once = cm.all_reduce(w, 0)
        time_ = StepTime(t.compute_s / a, t.communication_s / a + once, t.resharding_s / a,
                         t.optimizer_s)  # fmt: skip
        static = m.static - x.inputs * (1 - 1 / a)  # the input leaves are a replica's rows
        mem = StageMemory(static, w, m.update_temp, m.saved / a, acts + w, m.accumulated, read_back=m.read_back,
                          grads_held=m.grads_held)  # fmt: skip
    # the gradients' sync once a step (StageCost.sync_s): the base's, scaled as its collectives are, and axis 0's
    return _Piece(dataclasses.replace(x.cost, time=time_, sync_s=x.cost.sync_s / a + once), mem)


def _transposed_earlier(shape: Sequence[int], earlier: Sequence[tuple[int, int]]) -> bool:
    """Whether `shape`'s transpose ``(b, a)`` (a ≠ b) is among the `earlier` shapes (``_server_cap_levels``)."""
    a, b = shape
    return a != b and (b, a) in [tuple(x) for x in earlier]


def _cap_for(m: StageMemory, k: int, capacity: float, accumulated: bool = True, in_flight: int = 1) -> float:
    """The memory cap for the next plan of the block piece: its own peak scaled by how far k blocks of it
    (Eq. 5 with `in_flight` microbatches in flight; with `accumulated`, the summed gradients counted as
    :meth:`StackTable._offer` counts them) are over the device's capacity."""
    carry = m.carry
    acc = m.accumulated if accumulated else 0.0
    fb = k * (m.static + carry + acc) - carry + m.live_peak + (in_flight - 1) * k * m.saved
    need = max(fb, k * (m.static + m.grads + m.update_temp))
    own = max(m.static + m.live_peak + acc, m.static + m.grads + m.update_temp)
    return own * capacity / need


def compose_stage(
    planner: StagePlanner,
    stack: Stack,
    start: int,
    stop: int,
    ranks: Sequence[int],
    mesh_shape: Sequence[int],
    *,
    microbatches: int,
    capacity: float | None = None,
    block_capacity: float | None = None,
    block_zero: ZeroMode | None = None,
    recompute: Recompute = Recompute.NONE,
    accumulated: bool = False,
    ends: StagePlanner | None = None,
    block_gap: float | None = None,
    **kw,
) -> StageCost:
    """The stage of model layers ``[start, stop)`` of `stack` on `ranks` as `mesh_shape`, composed from its
    pieces (module docstring, 2): the pre and post parts planned under `capacity`, the blocks as k times a
    middle block planned under `block_capacity` (default: `capacity`). `kw` goes to ``StagePlanner.plan`` for
    every piece (``zero``, ``force``: a Megatron stage's pinned layouts; `block_zero` overrides ``zero`` for the
    block). `recompute`: `stack` is the recomputing graph's (``StackTable.recomputed``), so a stage with blocks is
    marked recomputed (``StageCost.recompute``); `ends`: the planner of the pre and post parts (default
    `planner`), the captured graph's where `planner` is a recomputing one (recomputation copies blocks only,
    so the tables plan those parts once). `accumulated`: the forward + backward peak holds every piece's
    gradients summed over the microbatches (``StageMemory.accumulated``; both tables by default). `block_gap`: the
    block's MIP gap (``StagePlanner.plan(mip_gap=)``: the estimated table's capped blocks, :data:`PRICING_GAP`).
    Raises ``PlanError`` when a piece has no plan."""
    cap = float(capacity if capacity is not None else planner.cluster.device.memory_bytes)
    kw = {k: v for k, v in kw.items() if k != "capacity"}
    pre, nb, post = stack.parts(start, stop)
    asked: list[tuple[tuple[int, int], int, float]] = []
    if pre is not None:
        asked.append((pre, 1, cap))
    blk = (stack.middle, stack.middle + 1)
    if nb:
        asked.append((blk, nb, cap if block_capacity is None else block_capacity))
    if post is not None:
        asked.append((post, 1, cap))
    pieces = []
    for (a, b), w, c in asked:
        zkw = dict(kw, zero=block_zero) if block_zero is not None and w == nb and (a, b) == blk else kw
        zkw = dict(zkw, mip_gap=block_gap) if block_gap is not None and (a, b) == blk else zkw
        by = planner if (a, b) == blk or ends is None else ends
        cost, mem = by.plan_with_memory(a, b, ranks, mesh_shape, microbatches=microbatches, capacity=c, **zkw)
        pieces.append((_Piece(cost, mem), w))
    fb, upd, act, static, resident = _compose_one([(x.mem, w) for x, w in pieces])
    grads = sum(x.mem.grads * w for x, w in pieces)
    if accumulated:
        summed = sum(x.mem.accumulated * w for x, w in pieces)
        fb, resident = fb + summed, resident + summed
    time_ = _sum_time([(x.cost.time, w) for x, w in pieces])
    main = max(pieces, key=lambda xw: xw[1] * xw[0].cost.time.total_s)[0].cost
    peak = max(fb, upd)
    held_grads = grads if upd >= fb else 0.0
    memory = MemoryUse(
        params=static, grads=held_grads, optimizer=0.0, activations=0.0, inputs=0.0, capacity=cap,
        temporaries=peak - static - held_grads, row=0.0, peak_at="",
    )  # fmt: skip
    return StageCost(
        (start, stop), tuple(ranks), tuple(mesh_shape), main.mapping, time_, memory, PhasePeaks(fb, upd, act, resident),
        sum(x.cost.forward_s * w for x, w in pieces), sum(x.cost.search_s for x, _ in pieces),
        recompute if nb > 0 else Recompute.NONE,
        ZeroMode(block_zero).value if block_zero is not None and nb else None,
        sum(x.cost.sync_s * w for x, w in pieces),
    )  # fmt: skip


def _compose_one(pieces: Sequence[tuple[StageMemory, int]]) -> tuple[float, float, float, float, float]:
    """(forward_backward, update, activations, static, resident) of pieces in forward order, each repeated w
    times; resident: the static bytes and the gradients (``PhasePeaks.resident``)."""
    static = sum(m.static * w for m, w in pieces)
    carry = [m.carry for m, _ in pieces]
    total_carry = sum(c * w for c, (_, w) in zip(carry, pieces))
    fb = static + max(m.live_peak + total_carry - c for c, (m, _) in zip(carry, pieces))
    upd = static + sum((m.grads + m.update_temp) * w for m, w in pieces)
    act = sum(m.saved * w for m, w in pieces)
    return fb, upd, act, static, static + sum(m.grads * w for m, w in pieces)


def _accumulated(specials, blk: _Piece | None, PA, PB, NB) -> np.ndarray:
    """Per cluster range, the pieces' gradients summed over the microbatches (``StageMemory.accumulated``)."""
    pre = np.array([0.0 if x is None else x.mem.accumulated for x in specials[0]])
    post = np.array([0.0 if x is None else x.mem.accumulated for x in specials[1]])
    b = blk.mem.accumulated if blk is not None else 0.0
    return pre[PA] + NB * b + post[PB]


def _compose(specials, blk: _Piece | None, PA, PB, NB):
    """Vectorised :func:`_compose_one` over every cluster range: (T, fb, upd, act) arrays, T = ∞ where a
    piece has no plan."""

    def table(pieces: list[_Piece | None]) -> np.ndarray:
        # columns: t, static, carry, live, grads + update_temp, saved, present (live = -inf when absent)
        rows = []
        for x in pieces:
            if x is None:
                rows.append([0.0, 0.0, 0.0, -math.inf, 0.0, 0.0])
            else:
                m = x.mem
                rows.append(
                    [
                        x.cost.time.total_s,
                        m.static,
                        m.carry,
                        m.live_peak,
                        m.grads + m.update_temp,
                        m.saved,
                    ]
                )
        return np.array(rows)

    pre_t, post_t = table(specials[0]), table(specials[1])
    missing_pre = np.array([False] + [x is None for x in specials[0][1:]])
    missing_post = np.array([False] + [x is None for x in specials[1][1:]])
    b = table([blk])[0] if blk is not None else np.array([math.inf, 0.0, 0.0, -math.inf, 0.0, 0.0])
    P, Q = pre_t[PA], post_t[PB]
    with np.errstate(invalid="ignore"):
        T = P[..., 0] + np.where(NB > 0, NB * b[0], 0.0) + Q[..., 0]
    T = np.where(missing_pre[PA] | missing_post[PB], math.inf, T)
    static = P[..., 1] + NB * b[1] + Q[..., 1]
    carry = P[..., 2] + NB * b[2] + Q[..., 2]
    blk_live = np.where(NB > 0, b[3] + carry - b[2], -math.inf)
    fb = static + np.maximum.reduce([P[..., 3] + carry - P[..., 2], blk_live, Q[..., 3] + carry - Q[..., 2]])
    upd = static + P[..., 4] + NB * b[4] + Q[..., 4]
    act = P[..., 5] + NB * b[5] + Q[..., 5]
    return T, fb, upd, act
