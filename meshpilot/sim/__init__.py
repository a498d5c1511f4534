"""Discrete-event simulation of a plan's step schedule on its cluster (issue 9).

``simulate(plan)`` replays ``plan.step_schedule()`` action by action and returns a :class:`SimResult`: the
predicted step time and, per class of ranks, its split into compute, exposed communication, hidden
communication and idle time, plus a Chrome trace (:meth:`SimResult.chrome_trace`) and a PNG timeline
(:meth:`SimResult.write_png`). The closed-form ``plan.time`` assumes nothing overlaps; the simulator lets
issued collectives run beside compute, makes concurrent transfers share a link, and lets a slow rank hold
back the collectives it takes part in.

The model (each term → the code that computes it)
---------------------------------------------------

*Streams.* Every rank has one compute stream and one communication stream per layer of the cluster's
hierarchical matrix (``Cluster.layers``: e.g. the nodes' network and a node's NVLink).
:meth:`_Lowering.program` (in ``engine``) turns a rank class's actions into a program of ops: a compute action
``F3[a:b]`` becomes compute ops whose duration is
``sum(NodeChoice.seconds)`` of its nodes (``F``: every node that is not in the backward phase; ``B``/``I``/``W``:
the backward ones), times ``1 + pct/100`` on a straggler; a collective the schedule does not issue itself is
*blocking* (issue + wait) where the plan places it: an edge's before its consumer node, an op's own after the
op (the first ``OwnOp.leading`` of them before it: an expert-parallel MoE's counts and dispatch; duplex issues
those a stage early and waits for its combine a stage late, so the other microbatch computes beside them),
the loss' and buffers' at the end of the forward, the gradients' (``grad:``) at ``G``, once per step,
followed by the optimizer's update (a compute op of ``plan.time.optimizer_s``).
*Gradient buckets* (``StagePlan.grad_buckets``, ``meshpilot.planner.buckets``) replace their gradients'
``grad:`` collectives and run as the runtime runs them: where a step runs the backward once
(``buckets.backward_issues_buckets``: one microbatch, no ``I``/``W`` split) the backward issues bucket ``k``
right after the node that produces its last gradient (the ``src`` of that gradient's ``grad:`` collective) and
waits for every bucket at its end, so they run beside the rest of the backward; otherwise ``G`` issues all of
them, then waits for them, before the other gradients' collectives (:meth:`_Lowering._buckets`).
*Gather groups* (``StagePlan.param_gathers``, ``meshpilot.planner.prefetch``, under the schedules that run them:
``prefetch.active_gathers``) replace their edges' all-gathers by one all-gather of the group's bytes, issued
before the compute of its ``issue_at`` node (or at its first consumer) and waited for before its first
consumer (:meth:`_Lowering._groups`).
*Overlapped stage syncs* (``simulate(..., grad_syncs=)``, a pipeline plan with ``Plan.sync_overlap``: Megatron's
``overlap_grad_reduce``, Llama 3's FSDP): stage j's gradient sync, of its planned seconds ``s_j``
(``StageCost.sync_s``), is issued on the rank's DP stream right after the action that completes its weight
gradients for the last time (its last ``B``, or ``W`` where the backward is split:
:meth:`_Lowering._last_gradients`), all on the link of layer `sync_layer` (no latency split, busy factor 1); the
stream runs one at a time in issue order (the *Groups* rule, on a pseudo axis of the rank's own), while the
compute stream goes on with the other stages' backwards; ``G`` waits for every one of them, then runs the
stages' updates (``o_j``). Exposed is what is left of them after the rank's last backward
(:meth:`SimResult.exposed_s`).
``+c.m`` / ``-c.m`` issue / wait collective ``c`` of microbatch ``m``; ``S m>p`` starts a transfer to rank
``p`` (non-blocking), ``R m<p`` waits for it.

*Durations.* A collective's duration ``t`` is the cost model's (``CostModel.<kind>(nbytes, axis)`` of
``meshpilot.cluster.cost``: the fastest algorithm, already counting every group of the axis running at once,
ATP Eq. 3). It splits into a latency part ``L`` and a bandwidth part ``W = t - L``, read off the cost model
itself as ``L = 2 t(M) - t(2M)`` (exact while one algorithm wins at M and 2M; clamped to ``[0, t]``) in
:meth:`_Lowering.duration` (``planner.buckets.latency_work``, the split the planner's bucket pricing uses
too). A send takes ``CostModel.send_recv_ranks``. On a CPU device a collective's host cost ``h``
(``CostModel.compute_host_s``) is taken out of ``L`` and runs on the issuing rank's compute stream, just before
the issue (:meth:`_Lowering.issue`): gloo's work and the call share the cores the ranks compute on.

*Groups.* A mesh axis' process group runs one collective at a time, in the order its rank issues them (gloo's
work queue, NCCL's stream): a collective issued while its group runs another waits for it
(:meth:`_Sim._in_group`; a rank class's queue, so a straggler's group members are not synchronised by it).

*Links, processor sharing.* A transfer occupies the link of the outermost layer its group crosses
(:meth:`_Lowering.layer_of`), per rank: ``(sim rank, layer)`` in :class:`_Link`. After ``L`` it joins the
link; with ``k`` transfers active each progresses at rate ``1/k`` (processor sharing): at every event
``remaining_i -= (now - last) / k`` and the next completion is ``now + k * min(remaining)``
(:meth:`_Link.advance`, :meth:`_Link.next_finish`). Alone, a transfer takes exactly ``t``; two of ``t1 <= t2``
(of two groups) issued together end at ``2 t1`` and ``t1 + t2``.

*Contention* (CPU devices). A collective's busy factor ``f`` (``CostModel.busy_factor``: the axis' all-reduce
measured while every rank computes over the same alone, ``Calibration.busy_curve``; 1 on GPUs and without the
measurement) slows it while its rank's compute stream runs: its latency then elapses at rate ``1/f`` and its
link share at ``1/(k f)`` (:meth:`_Link.advance`, ``_Transfer.slow``); when the compute stream starts or stops
(:meth:`_Sim._set_busy`) the rest of each slowed latency and the link's next completion are rescheduled at
the new rates. A collective wholly beside compute takes ``f t``, one wholly after it ``t``.

*Dependencies.* A collective of a group starts (``ready``) when the last member issued it:
``ready = max_{j in group} issue_j`` (:meth:`_Sim._issue`); a wait blocks the compute stream until the
transfer's end. So a straggler's late issue delays every member of its groups, and everything after.

*Rank classes, symmetry.* Ranks that run the same actions with the same speeds and whose groups hold the same
mix of such ranks behave identically, so one representative is simulated for each. :func:`rank_classes`
finds them by colour refinement: colour_0(r) = (schedule class of r, straggler pct of r); colour_{i+1}(r) =
(colour_i(r), for every mesh axis the sorted colours of r's group on it), until the number of colours stops
growing (an equitable partition: a member's issue time depends only on its colour). An SPMD plan without
stragglers is one class whatever the world size; one straggler on a 2D mesh gives at most four (itself, its
row, its column, the rest). Ranks with sends / receives keep their own colour.

*Split* (per class, :func:`_split`): ``compute`` = busy time of the compute stream; ``comm`` = measure of the
union of its transfers' active intervals (after the group is ready, latency included); ``hidden`` = the part of
``comm`` that overlaps compute; ``exposed = comm - hidden``; ``idle = step - compute - exposed`` (waiting for
peers, for a straggler, or for the step's end). ``step`` = the latest end over all classes.

*Overlap ratio* (HiDup Table 4; :attr:`ClassTime.overlap_ratio`, :func:`overlap_ratio`): ``hidden`` ÷
``min(compute, comm)`` — the share of the smaller of the two streams that runs beside the other.

Not modelled: compute slowed by communication, contention for SMs or memory bandwidth on GPUs, network
topology below a layer (a layer is one shared resource per rank), per-message protocol effects.
"""

from meshpilot.sim.engine import (
    ClassTime,
    SimResult,
    TraceEvent,
    overlap_ratio,
    parse_straggler,
    rank_classes,
    simulate,
    write_timelines,
)

__all__ = [
    "ClassTime",
    "SimResult",
    "TraceEvent",
    "overlap_ratio",
    "parse_straggler",
    "rank_classes",
    "simulate",
    "write_timelines",
]
