"""The optimizer step inside backward: each parameter is updated as soon as its gradient is
complete, and the gradient is freed, so gradients never pile up.

``handle = slimgrad.step_in_backward(model, torch.optim.AdamW, lr=1e-3)`` registers a
``register_post_accumulate_grad_hook`` on every trainable parameter. When autograd has accumulated
a parameter's gradient for this backward, the hook runs the optimizer's update for that parameter
alone and sets ``.grad`` to None. The parameters after the step are bit for bit those of the plain
loop ``loss.backward(); opt.step(); opt.zero_grad()`` with ``opt = AdamW(model.parameters(), ...)``.

Memory: the gradients alive at any moment of backward are those of the autograd node running now
(a layer's weight and bias come out of one node) and nothing else; the plain loop keeps every
gradient from the moment backward reaches it until ``opt.step()``, so its peak (usually at the end
of backward) holds all of them. An untied head under slimgrad's fused loss is not even whole: one
block of its gradient rows at a time (NOTE [Chunked updates]).

# NOTE [Why the update is exact]
The handle holds one ordinary optimizer (``handle.optimizer``, built as ``OptimizerClass(params,
**kwargs)``): its ``param_groups`` and ``state`` are the handle's, in the plain optimizer's format.
The hook of parameter ``p`` narrows the optimizer to ``p`` for one call of its own ``step()``
(``param_groups`` becomes ``[group]`` with ``group["params"] == [p]``; restored afterwards) and runs
it. Every ``torch.optim`` optimizer that needs no closure updates each parameter from that
parameter's gradient and state alone, elementwise, so narrowing the call changes nothing in the
bits: the single-tensor, foreach and fused implementations compute the same per-element formula for
a list of one tensor as for a list of many (the default implementation is chosen per group from
device and dtype, identical for the plain loop and here when a group's parameters share a device).
Autograd sums every contribution to a leaf before its ``AccumulateGrad`` runs, and the
post-accumulate hook fires once per backward per leaf, after that: a parameter used twice (tied
embeddings) is updated once, from the summed gradient, as in the plain loop. Frozen parameters get
no hook; a parameter that gets no gradient in a backward sees no hook call, so it is left alone as
``opt.step()`` leaves a parameter whose ``.grad`` is None (the plain loop with the default
``zero_grad(set_to_none=True)``; a loop that zeroes gradients in place is followed too: NOTE
[Gradients zeroed in place]).

The update writes the parameter in place while backward goes on. Every node that computes a
gradient for ``p`` has run by then; a node that keeps ``p`` without computing its gradient (a
``.detach()``ed use, a frozen copy sharing storage) and runs later meets autograd's version check
("modified by an inplace operation") where the plain loop works. The same check (or the refusal
below) stops a second backward over a retained graph.

# NOTE [Small parameters update together]
One optimizer call costs the same Python overhead (``_init_group``, dispatch, grad mode) whatever
it updates: per parameter, a model of many small tensors (biases, norm weights) would pay it
hundreds of times per step, for nothing, since their gradients are small. A parameter smaller than
``bucket_bytes`` (default 1 MiB) waits in a list until the waiting gradients reach
``bucket_bytes`` or backward ends (an engine callback), then the list updates in one call,
narrowed per group. Parameters are independent in every such optimizer, so the bits do not
change; the memory bound grows by at most ``bucket_bytes``. ``bucket_bytes=0`` updates every
parameter alone. The list updates in the plain step's order (each group's parameters in the
group's order), not in the order their hooks ran: a single-tensor update keeps one parameter's
temporaries until the next parameter's are made (AdamW's denominator), so its peak is a fact of
the order; in backward's order a tiny Mixtral whose whole model waits in one bucket peaked
32,260 B above the plain loop's step; in the plain order it peaks as that step, but for the
loss's own gradient, which ``loss.backward()`` holds until it returns (4 B for a float32 scalar;
tests/test_step_in_backward.py).

# NOTE [Chunked updates]
SGD, Adam and AdamW update each element of a parameter from the same element of its gradient and
state, and the step counter. A large parameter (more than ``CHUNK_ELEMS`` elements) is updated
piece by piece: the optimizer's own ``step()`` runs on views of ``CHUNK_ELEMS`` elements of the
parameter, gradient and state, each piece counting from a copy of the step counter except the
last, which advances the real one (once, as the whole update does). The optimizer's temporaries
(AdamW's ``sqrt`` and division, 2 x the parameter) are one piece's. Bit-identity is not automatic:
ATen's CPU loops compute a vector body and a scalar tail, and split the tensor across threads, so
a piece boundary moves elements between the two; it holds when both compute the same bits, which
tests/test_step_in_backward_chunked.py checks for every proven case (SGD with momentum, nesterov,
dampening, weight decay; Adam with amsgrad and weight decay; AdamW; maximize; foreach True and
False; pieces aligned and unaligned to the vector width, a last partial piece, two threads).
Chunking is restricted to those: exactly those three classes, CPU tensors, not fused, capturable
or differentiable, contiguous parameter, gradient and state of the parameter's shape and dtype,
and state that exists (the first step creates it from the whole gradient, so it is whole).
Anything else updates whole.

The untied LM head goes further (NOTE [Head gradient by vocabulary blocks] in
slimgrad/_math/linear_cross_entropy.py): the fused loss's backward offers each block of the head's
gradient rows, complete over every token, to the handle (``ROW_SINK`` on the weight), which
updates those rows as above and frees the block: the head's full gradient never exists. The op
offers them only for a leaf weight no other node below it reaches (a tied embedding is reached
through the hidden states: whole), only when this backward accumulates into ``.grad`` (not
``torch.autograd.grad``) and not under ``create_graph``; the handle takes them only in the
chunkable cases above, with ``accumulate=1`` and without ``clip_grad_norm_per_param`` (it needs the
whole gradient; ``clip_grad_value`` is elementwise and applies per block). The row path runs in
the plain loop too (it is the op's full-precision backward), so both compute the same gradient
bits. A use of the weight beside the loss (``loss + f(W)``) is not below the op: its gradient
arrives after the rows were updated, and the handle raises.

# NOTE [What a step is, and what is refused]
In the plain loop a step is everything between two ``opt.step()`` calls. Here the update happens in
backward, so the handle needs to know when a step ends:

- ``handle.step()`` and ``handle.zero_grad()`` are no-ops on the parameters (the update already
  happened; there is no gradient to zero). The handle follows them, and the module's
  ``zero_grad()``, to know what the plain loop's ``.grad`` would hold (NOTE [What the loop did
  since the last update]): a second backward with no ``step()`` since the last (two losses
  backward'ed separately, even over disjoint parameters: backward their sum once; micro-batch
  accumulation without ``accumulate=N``; a loop without ``step()``) and a backward after
  ``step()`` with no ``zero_grad()`` (the plain loop sums the steps' gradients) are refused at
  that backward's first hook, before any change. ``accumulate=N`` is the exact mode for
  accumulation; ``check_loop=False`` declares every backward a whole step.
- ``backward(retain_graph=True)`` (and ``create_graph=True``, which keeps the graph too) in a
  backward that updates (every backward with ``accumulate=1``, the last of a cycle otherwise) is
  refused at its first hook: the update writes the parameters in place, so a second backward over
  the kept graph would fail autograd's version check ("modified by an inplace operation") where it
  saved a parameter, or step twice where it did not. After the refusal nothing changed and the
  kept graph is intact: ``loss.backward(retain_graph=True); loss.backward()`` raises at the first
  call, and the second call (without ``retain_graph``) is an ordinary step. Backwards that only
  accumulate (``accumulate=N``, not the last) may keep their graph: nothing is written in place
  yet. (The query is torch's private ``_get_current_graph_task_keep_graph``; without it this
  refusal is off and the old errors remain.)
- Global-norm clipping (``clip_grad_norm_(model.parameters(), c)``, which HF Trainer runs by
  default) needs every gradient before the first update; after backward it finds every ``.grad``
  None, returns 0 and clips nothing. It cannot be detected from here: ``clip_grad_norm_`` reads
  ``p.grad`` through the tensor's C getter and calls nothing a hook sees, and slimgrad does not
  patch torch. An exact global clip is impossible for the reason that rules out GradScaler below
  (the norm needs the whole gradient set before the first update). Use ``clip_grad_norm_per_param``
  (each parameter clipped by its own norm: a different clip, exactly the plain loop's
  ``for p in params: clip_grad_norm_([p], c)``) or ``clip_grad_value`` (elementwise: exactly the
  global ``clip_grad_value_``), and turn the loop's own clipping off (HF: ``max_grad_norm=0``).
- DDP and FSDP reduce gradients across processes after accumulation; the update must wait for the
  reduction. The handle refuses a DDP/FSDP-wrapped module, DTensor parameters, any backward run
  while a process group of more than one process is initialised, and any parameter a live
  DDP/FSDP wrapper holds, at any world size, whether it wrapped the model before or after the
  handle was made (NOTE [Parameters a DDP or FSDP reduces]).
- Optimizers whose ``step`` needs a closure (LBFGS) re-evaluate the loss: refused.
- ``torch.amp.GradScaler``: refused (NOTE [GradScaler]).

# NOTE [What the loop did since the last update]
The plain loop updates at ``opt.step()`` from what ``.grad`` holds: the sum of every backward
since the last ``zero_grad()``. The handle updates in each backward from that backward's gradient
alone, so the two agree only when every step is one backward between a zeroing and a
``step()``. The handle cannot read ``.grad`` for this (it is None between backwards, and must stay
what user code sees in the plain loop or None: a marker tensor left there broke ``p.grad.view``,
``clip_grad_norm_``, ``.numpy()`` and sparse embeddings), so it follows the calls it can see:

- its own ``step()`` and ``zero_grad()`` (wrappers such as accelerate's and Lightning's optimizers
  forward to them);
- ``zero_grad()`` of the module given to ``step_in_backward``, or named by ``module=`` when the
  handle is built from parameters or param groups (HF Trainer builds weight-decay groups and
  zeroes with ``model.zero_grad()``: ``step_in_backward(groups, AdamW, module=model)``; the
  module must hold every handle parameter): an instance attribute on that one module (not a
  patch of the class) that tells the handle, then runs the ``zero_grad`` the module had; one
  Python call per ``model.zero_grad()``; ``remove()`` takes it off (an instance-level
  ``zero_grad`` the module had is put back); ``torch.save``/``pickle``/``copy.deepcopy`` of the
  module give a copy without it (NOTE [A watched module's copies carry no watch]).

From these, three states: nothing held (zeroed since the last update, or never updated), updated (an
update ran in a backward; the plain loop holds its gradients, not yet stepped: NOTE [A backward that
raised]), stepped (``step()`` came; the plain loop still holds them). Each backward that starts a
step (every backward; with ``accumulate=N`` the first of a cycle) checks at its first hook, before
any change: after "updated" it is a second backward in one step (the plain loop sums and steps
once); after "stepped" the gradients were not zeroed (the plain loop adds this backward's to the
last step's). ``step()`` after "stepped" is refused too (the plain loop applies the same gradients
again; they were freed). ``zero_grad()`` after "updated" (between backward and ``step()``: the plain
loop discards the gradients and its ``step()`` does nothing) is refused after the fact: the update
already happened in backward. A ``step()`` with nothing held changes nothing, in both loops.

What cannot be told apart: once ``.grad`` is None, a loop that zeroes with ``p.grad = None``, with a
submodule's or another optimizer's ``zero_grad()``, or with the model's ``zero_grad()`` when the
handle was given a parameter list without ``module=``, changes nothing the handle can observe,
exactly as a loop that never zeroes. Both are refused (the message names ``handle.zero_grad()``, and
first ``module=model`` for a handle built from parameters); ``check_loop=False`` is the explicit
answer for such a loop, and for a loop without ``step()`` calls: every backward (every
``accumulate`` backward calls) is then one whole step, ``zero_grad(); backward(); step()``, and
nothing is checked (such a loop that does not zero, or accumulates, differs silently: the option
says the loop does neither).

# NOTE [A step that ends a cycle early]
With ``accumulate=N`` the update runs in the N-th backward of a cycle. A ``step()`` after fewer
(accelerate's ``accumulate()`` syncs and steps at the end of the dataloader, so an epoch of an odd
number of batches at N = 2 ends with a cycle of one) is the plain loop's ``step()`` on what
``.grad`` holds: the sum of the cycle's backwards so far, which the handle holds in ``.grad`` as
the plain loop does until the cycle's last backward. So ``step()`` updates every handle parameter
whose ``.grad`` is not None, as the end of a whole cycle updates those that got no gradient in its
last backward, and the next backward starts a new cycle (accelerate resets its count there too).
The update is the same per-parameter call of the optimizer as in backward: the plain loop's bits.
``zero_grad()`` in the middle of a cycle stays refused, before any change, except after a backward
that raised (NOTE [A backward that raised]).

# NOTE [A backward that raised]
A backward can raise in its middle (an out-of-memory in one node; fairseq then calls
``zero_grad()`` and moves to the next batch). The plain loop then holds, in ``.grad``, the
gradients of the parameters whose ``AccumulateGrad`` ran (added to the earlier micro-batches'),
the earlier micro-batches' sums for the others, and has changed nothing else. The handle has
updated the parameters its hooks updated (only in a backward that updates: a parameter of at
least ``bucket_bytes``, each as its hook ran), and the others hold what the plain loop's hold:
the waiting bucket's with this backward's gradient (NOTE [Small parameters update together]),
the rest with the earlier micro-batches'. Undoing an update is not exact (nor cheap: a copy of
each parameter and its state), so the handle takes the plain loop's state from there on.

It learns of the error at once: the end callback it queues with the engine at a step's first hook
(``_EndOfBackward``) is freed with the graph task, run or not, and one freed unrun (``__del__``,
while the error leaves ``backward()``) means that backward raised; no callback of the engine's
runs on an error, and waiting for the next call would take the next backward for a nested one.
It then ends the step's backward, forgets the waiting bucket (those gradients stay in ``.grad``),
and records what is held: the raised backward does not count as a micro-batch unless an update ran
in it (then its cycle is over). From there, as the plain loop:

- ``step()``: updates every handle parameter whose ``.grad`` is not None, as the plain ``step()``
  applies what ``.grad`` holds, at any micro-batch position; the cycle ends. Where the backward
  raised in its middle (its end callback unrun) and some handle parameter got no gradient in it,
  that is a partial update of the batch: ``step()`` warns, saying how many gradients it applies
  and how many parameters got none (``zero_grad()`` drops the batch), and whether the plain loop's
  ``step()`` after the same error does the same (an error in a node) or not (an error in one of
  the handle's updates: the plain loop's comes at ``step()``, after the whole backward). An
  error in the end callback's updates comes after every node ran: no warning.
- ``zero_grad()`` (the handle's or the watched module's): drops what ``.grad`` holds, as the plain
  one (``set_to_none=False``: the zero tensors it keeps, NOTE [Gradients zeroed in place]), in
  the middle of a cycle too; the cycle ends. Where an update ran in the raised backward it is
  refused after the fact, once (the plain loop discards gradients the handle applied), as between
  any backward and ``step()``: everything is dropped all the same and the loop goes on.
- another backward with neither: the plain loop adds to what ``.grad`` holds. Where no update ran
  (and no gradient left was clipped, below) the handle does the same (the held gradients accumulate;
  those this backward does not reach update at its end, with ``accumulate=1`` too, or at the cycle's
  end). Where one ran it is refused, before any change: with ``accumulate=N`` the tensor pre-hooks
  refuse before ``AccumulateGrad`` adds; with ``accumulate=1`` a tensor hook is put on each held
  parameter for that (``_HeldGuard``; removed at the next ``step()``/``zero_grad()`` or the backward
  that goes on), the others' ``.grad`` being None.
- ``check_loop=False`` (every step ``zero_grad(); backward x N; step()``): the next backward that
  starts a step (every one with ``accumulate=1``, a cycle's first) drops what the raised one left
  before adding to it; within a cycle the held gradients go on accumulating.

A refusal of the handle's own, raised from its hook in a backward that has updated nothing yet,
is not such an error: it changes nothing (NOTE [Every refusal changes nothing]). An error in an
update (an optimizer step pre-hook, an out-of-memory in the optimizer) is one: its parameters'
``AccumulateGrad`` ran, so their gradients stay in ``.grad`` (a fused-loss head's block: inside the
loss's node, the head got none), and a retried ``step()`` applies them (an update by pieces, NOTE
[Chunked updates], that raised after some pieces goes on from the first piece not applied, while
``.grad`` holds the same gradient). A retry that raises again keeps what it did not apply, for the
next ``step()``/``zero_grad()``. With ``clip_grad_norm_per_param``/``clip_grad_value`` the gradient
was clipped in place before the update that raised: the retried ``step()`` does not clip it again
(the plain loop clips once, then steps; clipping twice moved a norm-clipped gradient by an ulp),
told by the gradient tensor and its version recorded at the clip. Unclipping is not exact, so a
backward that would add to such a gradient (the plain loop adds to the unclipped one and clips the
sum) is refused before any change, as after an update (the cycle ends there too); ``step()`` or
``zero_grad()`` first. Left: a reentrant
checkpoint's node that raises after its nested backward ended and before it returns (a user's
post-hook on that node) is seen only at the next ``step()``/``zero_grad()``.

# NOTE [Gradients zeroed in place]
``zero_grad(set_to_none=False)`` (the handle's or the watched module's) leaves, in the plain loop,
a zero tensor in every ``.grad`` that held a gradient: a strided one is zeros, a sparse COO one
(``Embedding(sparse=True)``) has no entries. Two things follow, both done by the handle from what
it saw (the parameters that got a gradient since the last zeroing, and that gradient's layout),
without ever leaving a tensor in ``.grad`` between backwards:

- the next gradient is ``zero + g``, computed by AccumulateGrad: for strided ``g`` its ``-0.0``
  become ``+0.0`` (SGD then keeps a ``-0.0`` parameter ``-0.0``); the handle, whose ``.grad`` was
  None, applies ``g.add_(0.0)`` (IEEE addition commutes: the same bits) before the update, or
  AccumulateGrad's own sum where the layouts differ (dense ``+=`` sparse; sparse ``+`` dense;
  sparse ``+=`` sparse on an empty coalesced tensor, as sparse ``zero_()`` leaves); for a head
  updated by row blocks, each block gets ``+ 0.0``;
- ``step()`` updates every parameter whose ``.grad`` is such a zero and got nothing since
  (momentum, weight decay, Adam's moments and step count move): the handle runs that update at
  ``step()`` with the same zero gradient (made for the call and freed), and in a ``step()`` with
  no backward since, for all of them. A zeroing with ``set_to_none=True`` ends it.

Only zeroing the handle sees counts; with ``check_loop=False`` nothing is followed (every backward
is the ``set_to_none=True`` loop's step).

# NOTE [A reentrant backward is not a second backward]
A reentrant checkpoint (``use_reentrant=True``) runs a nested backward inside the enclosing one;
when the handle's first hook of a step runs inside it, that backward's end callback fires when
the nested one ends, and the enclosing backward goes on after it (from the checkpoint node's own
backward). A step is the enclosing backward, however many nested ones run in it and whichever of
them reaches the handle's parameters first:

- the handle's first hook runs in the enclosing backward: a nested one starting later is the
  same step (its hooks see ``_task`` set and queue no end callback);
- the first hook runs in a nested backward (the checkpointed layers last in the model, or every
  layer checkpointed): that backward's end callback fires when the nested one ends, still inside
  the enclosing backward's node. torch answers which node runs now
  (``torch._C._current_autograd_node``, private, guarded): None at the top level. A nested end
  leaves the waiting bucket waiting (a parameter the enclosing backward reaches again gets a
  second gradient: refused before its update, NOTE [A parameter in and around a reentrant
  checkpoint]; the bucket's bound holds either way), keeps the step open and registers a
  post-hook on that node; when the node returns, the hook makes the enclosing backward the step's
  (its graph task, its end callback), so the cycle count, the updates of parameters that got no
  gradient in a cycle's last backward and the end of the step wait for the real end. Adjacent
  segments, segments inside segments and an enclosing backward that reaches no handle parameter
  after the nested one are then one step; an enclosing backward that raises before its node
  returns leaves the hook behind, removed at the next ``step()``/``zero_grad()``.
- a parameter reached in two of them (used inside and outside a checkpointed segment) gets two
  gradients in one backward: refused, NOTE [A parameter in and around a reentrant checkpoint].

# NOTE [A parameter in and around a reentrant checkpoint]
With ``accumulate=N`` a parameter's second gradient in one backward can only come from a nested
reentrant backward and its enclosing one (a later backward is the next micro-batch). The tensor
pre-hook sees it before ``AccumulateGrad`` adds it and refuses with the use_reentrant message, at
the first micro-batch where it happens. In a micro-batch that does not update nothing was
applied, so the refusal undoes what the backward did: the cycle count is as before it, and a
``.grad`` that was None when the backward first reached its parameter is None again (the
first micro-batch after ``zero_grad()``: everything as before). A ``.grad`` that held earlier
micro-batches keeps this backward's partial sum, as the plain loop's after a failed backward
(``step()`` applies it, ``zero_grad()`` drops it: NOTE [A backward that raised]). Where it is first
seen in the updating micro-batch, parameters reached before it may be updated: a refusal after the
fact.

With ``accumulate=1`` each gradient is complete for its own graph task and the post-accumulate
hook of the first may already have updated the parameter; each hook records the graph task of the
gradient it saw (the one ``_start_backward`` read anyway), so a second one from another task of the
same step is this case: a GUIDE-form error naming the parameter (its name in the watched module)
and the reentrant checkpoint, before any change where this backward has updated nothing yet (the
waiting bucket: small models; its gradients go again), after the fact otherwise. Exact support
would hold back the update of every parameter a nested backward reaches until the step ends, and
the outside use may come first (its gradient complete in the enclosing task, then the nested one
adds): nothing at the first gradient says a second comes. ``use_reentrant=False`` runs one
backward, so the parameter gets one summed gradient: exact, at no cost here, and the error says so.

Graph tasks are numbered in creation order (an atomic counter in the engine), so a task numbered
below the last one the handle started in can only be one that encloses it: without the node
query that is how an enclosing backward going on is recognised (the same step with
``accumulate=1``; refused with ``accumulate=N``, after the nested backward's updates, as before).

# NOTE [GradScaler]
Exact support is impossible: the scaler skips the whole step when any gradient holds an inf or a
nan, so every gradient must be checked before the first parameter changes; here a parameter is
updated as soon as its own gradient is complete, and undoing an update is not exact (nor cheap:
a copy of the parameters and state). So a scaled loss is refused before the first update. Whether
this backward's loss went through ``scaler.scale`` cannot be seen from a post-accumulate-grad
hook (the graph's root is not reachable from it; torch's private
``_current_graph_task_execution_order`` asserts once the backward has started), so the handle asks
a fact it can see: at its first backward, the garbage collector lists every live instance of
``torch.amp.GradScaler`` and its subclasses (one walk over the tracked objects, once per
handle); any enabled one refuses that backward at its first hook (public API only: ``is_enabled()``,
not ``_scale``). Conservative: an enabled scaler kept for another model refuses too (the message
says so; ``GradScaler(enabled=False)`` passes and is the plain loop). A scaler made after that first
backward is seen at the next backward's first hook, before its first update: every instance of a
Python class holds a reference to its class, so each backward compares the reference counts of
``GradScaler`` and its subclasses (``sys.getrefcount``, no heap walk) with those of the last scan
and scans again where one changed (a new scaler, a new subclass, or any other new reference to the
class: a scan that finds no enabled scaler then records the new counts). Before, such a scaler was
seen only by ``scaler.step(handle)``, after that backward had updated the parameters with scaled
gradients. A scaler the last scan saw (enabled or not) is held by a weak reference whose callback
makes the next backward scan again: a scaler rebound (``scaler = GradScaler()`` over a disabled one:
the new instance's reference and the old one's release leave the count as it was) is refused too.
Left: a reference to a scaler class held by something other than a scaler (``cls =
torch.amp.GradScaler``) dropped while an enabled scaler is made between two backwards leaves the
count as it was: that scaler is then seen at ``scaler.step(handle)``, late, as before.

# NOTE [Every refusal changes nothing]
A refused call leaves the parameters, the optimizer state, every ``.grad`` and the LR scheduler
as they were (tests/test_step_in_backward_refusals.py compares them bit for bit):

- ``step_in_backward()``: every argument check, the DDP/FSDP/DTensor/process-group checks (a live
  wrapper of its parameters too), the held-gradient check and the ownership check of every group
  run before the first hook is attached. ``add_param_group``: checked before the group is added.
- In backward, at the handle's first hook of that backward, before any update: a second backward in
  one step, ``retain_graph``/``create_graph``, a live enabled GradScaler, a frozen parameter now
  requiring grad, several processes, a live DDP/FSDP wrapper of its parameters (made after the
  handle: NOTE [Parameters a DDP or FSDP reduces]), a ``.grad`` written after the last update freed
  it (the same NOTE). The hook runs after ``AccumulateGrad`` wrote that one parameter's ``.grad``:
  with ``accumulate=1`` it was None before (every handle parameter's is, between backwards; a
  stale one a reducer wrote goes with it), and the refusal sets it back; with ``accumulate=N`` a
  tensor hook runs the same checks before the gradient is added to the earlier micro-batches'.
- In backward, at the same first hook: a second backward with no ``step()`` since the last, and a
  backward after ``step()`` with no ``zero_grad()`` (NOTE [What the loop did since the last
  update]); with ``accumulate=N`` both at the first micro-batch of a cycle. A backward after one
  that raised once it had updated, or in an update of a gradient it had clipped in place (NOTE
  [A backward that raised]: a tensor hook on each gradient that one left refuses before it is
  added to).
- In backward, later, in a backward that has updated nothing yet: a parameter reached inside and
  outside a reentrant checkpoint. With ``accumulate=1`` every gradient this backward made is
  dropped again with its records (each ``.grad`` was None before it); with ``accumulate=N``, in a
  micro-batch that does not update, the cycle count and every ``.grad`` that was None are as
  before (a ``.grad`` holding earlier micro-batches keeps this backward's part, added in place:
  the plain loop's after a failed backward, NOTE [A parameter in and around a reentrant
  checkpoint]); the same for a nested backward refused without torch's node query.
- ``step()``/``zero_grad()``: a closure, a GradScaler call (the attributes the scaler set on the
  handle are removed), a call inside backward, ``zero_grad()`` in an unfinished accumulation
  cycle (``step()`` there: NOTE [A step that ends a cycle early]), a removed handle,
  a second ``step()`` with no backward and no ``zero_grad()`` between, ``step()`` while a live
  DDP/FSDP wrapper holds the handle's parameters or module (``fully_shard`` after the handle
  replaces the parameters, so no hook of the handle runs in backward), ``step()``/``zero_grad()``
  with a ``.grad`` written after the update freed it (NOTE [Parameters a DDP or FSDP reduces]);
  ``register_step_pre_hook``/``register_step_post_hook``; pickling.

The handle's own records are left as they were too. tests/test_step_in_backward_refusal_table.py
has a row per refusal: it compares all of these bit for bit, makes the call twice, then checks
that the loop goes on as the plain loop that never made it; a sweep over the module's raise sites
finds a row, or a named test among the late ones below, for each.

Refusals that come after a change they cannot undo, stated where they happen: ``zero_grad()``
between a backward and ``step()`` (the backward already updated; NOTE [What the loop did since the
last update]); a use of the fused loss's head weight beside the loss arrives after its rows were
updated (NOTE [Chunked updates]); a parameter reached both inside and outside a reentrant checkpoint
after an update in that backward (NOTE [A parameter in and around a reentrant checkpoint]), and
``retain_graph=True`` on a backward whose first handle hook ran in
such a checkpoint's nested backward (seen when the step resumes in the enclosing one: NOTE [A
reentrant backward is not a second backward]); a GradScaler made after the first backward while
another reference to a scaler class was dropped (the count unchanged: NOTE [GradScaler]); two
handles on one model (split optimizers): each checks at its own first hook, so when one refuses (its
loop was not zeroed) the other may already have updated its parameters in that backward (a hook of
each handle's parameters runs in graph order; no handle knows at its first hook which others this
backward reaches). That other handle is then "updated": its next ``zero_grad()`` raises once (after
the fact, as above) and the loop goes on; its ``step()`` first avoids that. Give both handles the
same zeroing (``module=model`` on each).
"""

from __future__ import annotations

import gc
import inspect
import sys
import types
import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.optim.optimizer as _optim_mod

from slimgrad.ops.linear_cross_entropy import ROW_SINK

__all__ = ["StepInBackward", "step_in_backward"]

_API = "slimgrad.step_in_backward"

# attribute of a parameter naming (weakly) the handle that updates it in backward: two handles on
# one parameter would update it twice
_OWNER = "_slimgrad_step_in_backward"


# NOTE [Chunked updates]: the optimizers whose update of a parameter is proven (tests) to give the
# same bits applied to pieces of it (views of the parameter, its gradient and its state) as to
# the whole tensor; elements per piece of a large parameter's update
_CHUNKED_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
CHUNK_ELEMS = 1 << 20

# NOTE [A reentrant backward is not a second backward]: whether torch answers which node runs now
_HAS_NODE_QUERY = hasattr(torch._C, "_current_autograd_node")


# NOTE [A graph task that accumulates nothing]
# A tensor hook of a leaf fires under ``torch.autograd.grad`` and ``backward(inputs=...)`` too,
# where the leaf's gradient is captured or not needed and its ``AccumulateGrad`` does not run:
# that task is no step of the plain loop, which it leaves as it was, so the handle's tensor hooks
# (``_PreHook``, ``_HeldGuard``) do nothing there. Which tasks run the node torch answers with the
# private ``torch._C._will_engine_execute_node``: probed once, at import, on a two-leaf graph (a
# backward that runs the leaf's node says yes, one with ``inputs=`` the other leaf says no).
# Without it (missing, or a wrong answer) the hook defers its work to a pre-hook of the
# ``AccumulateGrad`` node (``Node.register_prehook``, public), which the engine runs only when it
# runs that node, before the gradient is added: the same checks at the same point, one node hook
# more per parameter and backward. The fused loss's untied head then comes back whole (its rows
# are offered before the node runs, where only the query can tell): the same bits, its whole
# gradient alive once. ``slimgrad env`` and a handle's ``features_off`` say which.
def _probe_will_execute() -> tuple[bool, str]:
    name = "torch._C._will_engine_execute_node"
    query = getattr(torch._C, "_will_engine_execute_node", None)
    if query is None:
        return False, f"{name} is missing"
    answers: list[bool] = []
    try:
        with torch.enable_grad(), torch.inference_mode(False):
            for inputs in (None, "other"):
                x = torch.zeros(1, requires_grad=True)
                other = torch.zeros(1, requires_grad=True)
                y = x + other  # (saves no tensor: no saved-tensor hook sees the probe)
                node = torch.autograd.graph.get_gradient_edge(x).node
                y.register_hook(lambda g, node=node: answers.append(bool(query(node))))
                y.sum().backward(inputs=None if inputs is None else [other])
    except Exception as e:  # a probe must never break import
        return False, f"{name} failed ({type(e).__name__})"
    if answers != [True, False]:
        return False, f"{name} answered {answers}, expected [True, False]"
    return True, f"{name} answers"


_WILL_EXECUTE, _WILL_EXECUTE_WHY = _probe_will_execute()


def _features() -> tuple[tuple[str, bool, str], ...]:
    # (name, on, detail) of the private torch queries the handle uses: `slimgrad env`
    # (slimgrad._compat) and a handle's ``features_off``
    keep = hasattr(torch._C._autograd, "_get_current_graph_task_keep_graph")
    return (
        (
            "step_in_backward accumulation query",
            _WILL_EXECUTE,
            f"{_WILL_EXECUTE_WHY}: checks before a gradient is added, fused-loss head by row blocks"
            if _WILL_EXECUTE
            else f"{_WILL_EXECUTE_WHY}: checks before a gradient is added run in a pre-hook of "
            "its AccumulateGrad node (the same results); the fused loss's untied head updates "
            "whole, not by row blocks (its whole gradient alive once)",
        ),
        (
            "step_in_backward reentrant query",
            _HAS_NODE_QUERY,
            "torch._C._current_autograd_node present"
            if _HAS_NODE_QUERY
            else "torch._C._current_autograd_node missing: a reentrant checkpoint's backward in "
            "an accumulate=N cycle is refused",
        ),
        (
            "step_in_backward retain_graph refusal",
            keep,
            "torch._C._autograd._get_current_graph_task_keep_graph present"
            if keep
            else "torch._C._autograd._get_current_graph_task_keep_graph missing: "
            "backward(retain_graph=True) is not refused at its first hook; a second backward "
            "over the kept graph meets autograd's version check",
        ),
    )


class _ParamHook:
    # a tensor hook of one handle parameter, run before its AccumulateGrad adds this backward's
    # gradient, only in a backward that runs that node (NOTE [A graph task that accumulates
    # nothing]); holds the handle and the parameter weakly, as _RowSink
    __slots__ = ("ref", "param")

    def __init__(self, handle: StepInBackward, param: torch.Tensor) -> None:
        self.ref = weakref.ref(handle)
        self.param = weakref.ref(param)

    def __call__(self, grad: torch.Tensor) -> None:
        handle, p = self.ref(), self.param()
        if handle is not None and p is not None and not handle._removed:
            handle._if_accumulating(p, self.run)

    run: Any  # (a staticmethod of each subclass) what runs before the gradient is added


class _PreHook(_ParamHook):
    # accumulate=N: the backward's refusals before the gradient is added to the one of an
    # earlier micro-batch
    __slots__ = ()

    @staticmethod
    def run(handle: StepInBackward, p: torch.Tensor) -> None:
        handle._before_gradient(p)


def _no_handle() -> None:
    return None


class _EndOfBackward:
    # NOTE [A backward that raised]: queued with the engine's queue_callback; the engine runs it
    # when the backward ends and frees it with the graph task, run or not (a backward that raised
    # runs no end callback): freed unrun, it tells the handle while the error propagates
    __slots__ = ("ref", "token", "ran")

    def __init__(self, handle: StepInBackward, token: int) -> None:
        self.ref = weakref.ref(handle)
        self.token = token
        self.ran = False

    def __call__(self) -> None:
        self.ran = True
        handle = self.ref()
        if handle is not None:
            try:
                handle._end_backward()
            except BaseException:
                # an update at the end (the last bucket, gradients a raised backward left) raised,
                # e.g. in an optimizer step pre-hook: the backward raised, and the gradients not
                # applied stay in .grad as the plain loop's (zero_grad() drops them, step()
                # applies them); every node had run: a whole backward's gradients
                handle._backward_raised(partial=False)
                raise

    def __del__(self) -> None:
        if not self.ran:
            handle = self.ref()
            if handle is not None and handle._end_token == self.token:
                handle._backward_raised(partial=True)


class _HeldGuard(_ParamHook):
    # NOTE [A backward that raised]: with accumulate=1, on each parameter whose .grad a raised
    # backward left: the next backward's checks run before AccumulateGrad adds to it (the
    # post-accumulate hook comes after); removed at the next step start, step() or zero_grad()
    __slots__ = ()

    @staticmethod
    def run(handle: StepInBackward, p: torch.Tensor) -> None:
        handle._start_backward()


# NOTE [What the loop did since the last update]: the handle's view of the plain loop's gradients
_CLEAN = 0  # none held: zeroed (or never made) since the last update
_UPDATED = 1  # a backward updated the parameters; the plain loop holds its gradients, unstepped
_STEPPED = 2  # then step(): the plain loop still holds them until zero_grad()

# NOTE [A backward that raised]: what the last backward left when it raised
_RAISED_HELD = 1  # gradients in .grad (the plain loop's), no update ran in it
_RAISED_UPDATED = 2  # an update ran in it before the error
_RAISED_CLIPPED = 3  # no update ran, but gradients it left were clipped in place for one


def _zero_like(p: torch.Tensor, sparse_dim: int | None) -> torch.Tensor:
    # NOTE [Gradients zeroed in place]: the .grad the plain loop's zero_grad(set_to_none=False)
    # leaves: zeros (strided), or a sparse COO tensor with no entries
    if sparse_dim is None:
        return torch.zeros_like(p)
    idx = torch.empty((sparse_dim, 0), dtype=torch.long, device=p.device)
    val = torch.empty((0, *p.shape[sparse_dim:]), dtype=p.dtype, device=p.device)
    # (coalesced, as sparse zero_() leaves it)
    return torch.sparse_coo_tensor(idx, val, p.shape, is_coalesced=True, check_invariants=True)


def _plain_zero_grad(zero_grad: Any) -> Any:
    return zero_grad


def _not_watched(value: Any) -> Any:
    # the instance-level zero_grad / __getstate__ a module had under the watches on it (None: none)
    while isinstance(value, (_ZeroGradWatch, _StateWithoutWatch)):
        value = value.inner
    return value


class _ZeroGradWatch:
    # NOTE [What the loop did since the last update]: ``module.zero_grad``, set on the module
    # given to step_in_backward (its instance, not its class): tells the handle, then runs the
    # zero_grad the module had. remove() takes it off again. It holds the module weakly (no
    # reference cycle through the module's __dict__) and leaves copies of the module unwatched
    # (NOTE [A watched module's copies carry no watch]).
    __slots__ = ("ref", "module", "inner")

    def __init__(self, handle: StepInBackward, module: torch.nn.Module) -> None:
        self.ref = weakref.ref(handle)
        self.module = weakref.ref(module)
        d = module.__dict__
        # another instance-level zero_grad, kept (None: the class's runs)
        self.inner = d.get("zero_grad")
        d["zero_grad"] = self
        if not isinstance(d.get("__getstate__"), _StateWithoutWatch):  # one for every watch
            d["__getstate__"] = _StateWithoutWatch(module)

    def __call__(self, set_to_none: bool = True) -> None:
        handle = self.ref()
        if handle is not None and not handle._removed:
            handle._boundary("zero_grad()")
            if not handle._outside_module:
                # (a module that does not hold every handle parameter zeroes only some: not
                # followed, the next backward is refused as without zero_grad())
                handle._zeroed("model.zero_grad()", set_to_none)
        if self.inner is not None:
            return self.inner(set_to_none)
        module = self.module()
        return None if module is None else type(module).zero_grad(module, set_to_none)

    def count_outside(self, handle: StepInBackward) -> None:
        module = self.module()
        held = {id(p) for p in module.parameters()} if module is not None else set()
        handle._outside_module = sum(id(p) not in held for p in handle._group_index)

    def detach(self) -> None:
        module = self.module()
        if module is not None and module.__dict__.get("zero_grad") is self:
            d = module.__dict__
            inner = self.inner
            while isinstance(inner, _ZeroGradWatch) and inner.ref is _no_handle:
                inner = inner.inner  # watches of removed handles under this one go too
            if inner is not None:
                d["zero_grad"] = inner
            else:
                del d["zero_grad"]
            getstate = d.get("__getstate__")
            if not isinstance(inner, _ZeroGradWatch) and isinstance(getstate, _StateWithoutWatch):
                if getstate.inner is not None:
                    d["__getstate__"] = getstate.inner
                else:
                    del d["__getstate__"]
        self.ref = _no_handle  # a copy wrapped over this one (left in place) passes through

    def __reduce__(self):
        # not reached through the module's __getstate__ (it leaves the watch out); a module class
        # that copies its __dict__ itself (fx.GraphModule) gets the zero_grad the module had,
        # the class's bound to the copy (a reference cycle in that copy only)
        inner = self.inner
        if inner is None:
            module = self.module()
            inner = None if module is None else types.MethodType(type(module).zero_grad, module)
        return (_plain_zero_grad, (inner,))


# NOTE [A watched module's copies carry no watch]
# The watch is an instance attribute, so ``copy.deepcopy``, ``pickle`` and ``torch.save`` of the
# module would carry it into the copy's ``__dict__``; made from the watch's reduction, the copy's
# ``zero_grad`` was a method bound to the copy, held in the copy's own ``__dict__``: a reference
# cycle (the copy freed only by the garbage collector), and a handle made on the copy and
# removed left it there. The module's state is what ``__getstate__`` returns (copy and pickle
# both ask the instance), so the watch sets one more instance attribute, ``__getstate__``: the
# module's state without the watch (the ``zero_grad`` the module had under it, if any) and
# without itself. A copy has the module's class's ``zero_grad`` and no instance attribute, as a
# copy of an unwatched module; freed by reference counting. ``remove()`` takes both off.
class _StateWithoutWatch:
    __slots__ = ("module", "inner")

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = weakref.ref(module)
        self.inner = module.__dict__.get("__getstate__")  # an earlier instance-level one

    def __call__(self) -> dict[str, Any]:
        module = self.module()
        inner = _not_watched(self.inner)
        state = dict(inner() if inner is not None else type(module).__getstate__(module))
        for key in ("zero_grad", "__getstate__"):
            if key in state:
                value = _not_watched(state[key])
                if value is None:
                    del state[key]
                else:
                    state[key] = value
        return state

    def __reduce__(self):
        return (_no_handle, ())


# NOTE [A handle's marks pickle as none]
# A handle marks each parameter it updates with two attributes (``_OWNER``, the op's ``ROW_SINK``),
# each holding a weak reference to it. ``torch.save(model)`` and ``pickle`` carry a Parameter's
# ``__dict__``, and a ``weakref.ref`` cannot be pickled, so saving a model with a handle attached
# failed ("cannot pickle 'weakref.ReferenceType'"). Both marks pickle (and deep-copy) as marks
# naming no handle: a loaded or copied parameter is updated by no handle, which is what it was
# already (only the handle's own parameters count, ``_owner`` and ``_RowSink.__call__``).
class _HandleRef:
    __slots__ = ("ref",)

    def __init__(self, handle: StepInBackward | None = None) -> None:
        self.ref = weakref.ref(handle) if handle is not None else _no_handle

    def __call__(self) -> StepInBackward | None:
        return self.ref()

    def __reduce__(self):
        return (type(self), ())


class _RowSink:
    # the op's ROW_SINK attribute: a weak reference to the handle (a deep copy of the parameter
    # copies the attribute, and only the handle's own parameter counts)
    __slots__ = ("ref",)

    def __init__(self, handle: StepInBackward | None = None) -> None:
        self.ref = weakref.ref(handle) if handle is not None else _no_handle

    def __reduce__(self):  # NOTE [A handle's marks pickle as none]
        return (_RowSink, ())

    def __call__(self, weight: torch.Tensor, node: Any):
        handle = self.ref()
        if handle is None or weight not in handle._hooks:
            return None
        return handle._take_rows(weight, node)


def _accumulates(node: Any) -> bool:
    # whether this backward runs the weight's AccumulateGrad (not torch.autograd.grad, nor
    # backward(inputs=...) without it); torch refuses the question under autograd.grad. Only
    # where the probe found the query (NOTE [A graph task that accumulates nothing])
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:
        return False


def _owner(p: torch.Tensor) -> StepInBackward | None:
    ref = getattr(p, _OWNER, None)
    handle = ref() if ref is not None else None
    # a deep copy of the parameter carries the attribute: only the handle's own hook counts
    return handle if handle is not None and p in handle._hooks else None


def _err(cls, what: str, expected: str, got: str, fix: str) -> Exception:
    return cls(f"{_API}: {what}; expected {expected}, got {got}. {fix}.")


def _dist_classes() -> tuple[type, ...]:
    out: list[type] = [torch.nn.parallel.DistributedDataParallel]
    if torch.distributed.is_available():
        try:
            from torch.distributed.fsdp import FullyShardedDataParallel

            out.append(FullyShardedDataParallel)
        except ImportError:  # pragma: no cover - depends on the build
            pass
        try:
            from torch.distributed.fsdp import FSDPModule

            out.append(FSDPModule)
        except ImportError:  # pragma: no cover - depends on the build
            pass
    return tuple(out)


def _is_dtensor(p: torch.Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - depends on the build
        return False
    return isinstance(p, DTensor)


def _world_size() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def _keeps_graph() -> bool:
    # whether the backward running now keeps its graph (retain_graph=True or create_graph=True);
    # a private torch query: without it the refusal is off (NOTE [Every refusal changes nothing])
    query = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return bool(query()) if query is not None else False


def _enclosing_node() -> Any:
    # NOTE [A reentrant backward is not a second backward]: the autograd node whose backward runs
    # the backward that is ending (None at the top level). A private torch query: without it a
    # reentrant backward in an accumulate=N cycle is refused as before
    query = getattr(torch._C, "_current_autograd_node", None)
    return query() if query is not None else None


def _scaler_classes() -> list:
    classes, todo = [], [torch.amp.GradScaler]
    while todo:
        c = todo.pop()
        classes.append(c)
        todo.extend(c.__subclasses__())
    return classes


def _scalers_key() -> tuple:
    # NOTE [GradScaler]: every instance of a Python class holds a reference to its class, so a
    # scaler made (or dropped) since the last scan changes its class's reference count: the
    # classes' ids (an id holds no reference: a key holding the classes would change their counts)
    # and their counts, compared at each backward's first hook (no heap walk)
    return tuple((id(c), _getrefcount(c)) for c in _scaler_classes())


_getrefcount = sys.getrefcount


def _live_grad_scalers() -> list:
    # NOTE [GradScaler]: every live torch.amp.GradScaler (subclasses included), enabled or not. An
    # instance of a Python class references its class for the garbage collector, so
    # gc.get_referrers of the classes finds every instance (one walk over the tracked objects, paid
    # once per handle and again only where a scaler class's count moved or a seen scaler died; its
    # cost: docs/measurements.md)
    return [o for o in gc.get_referrers(*_scaler_classes()) if isinstance(o, torch.amp.GradScaler)]


def _forget_key(handle_ref: weakref.ref) -> Any:
    # NOTE [GradScaler]: a scaler seen by the last scan died: the next backward scans again (a
    # scaler rebound, ``s = GradScaler()`` over a disabled one, leaves the class's count as it was)
    def dead(_: weakref.ref) -> None:
        handle = handle_ref()
        if handle is not None:
            handle._scalers_key = None

    return dead


# NOTE [Parameters a DDP or FSDP reduces]
# DDP reduces each gradient after its ``AccumulateGrad`` (a hook of its reducer on that node, or a
# post-accumulate-grad hook with the Python reducer) and writes the reduced bucket back into
# ``.grad`` when backward ends; FSDP reduce-scatters it. The handle would update the parameter from
# its unreduced gradient and free it, and DDP would then leave a stale ``.grad`` that the next
# backward adds to (world size 1 too: the reducer runs the same). So a parameter that a live
# DDP/FSDP wraps is refused, whatever the world size and whichever came first, from public facts:
# the wrapper instances alive (every instance of a Python class references its class, so
# ``gc.get_referrers`` of DistributedDataParallel, FullyShardedDataParallel, FSDPModule and their
# subclasses, fully_shard's per-class ones included, finds them; the FSDP classes only once their
# module is imported, as an FSDP instance needs), and what each wraps (``parameters()``,
# ``modules()``). A wrapper relates to the handle when it holds one of its parameters, holds the
# module the handle watches or sits inside it (fully_shard replaces the parameters it shards:
# only the module tells). Checked at ``step_in_backward()``, ``add_param_group``, each step's first
# hook (before any change; a wrapper made after the handle) and ``step()`` (a wrapper that took
# the parameters away, so that no hook runs). The walk over the tracked objects runs once per
# process and again only where a wrapper class's reference count moved or a wrapper it saw died
# (the scan of NOTE [GradScaler], shared by every handle); between, the check compares the counts,
# and that of DDP's C++ ``Reducer`` class (one instance per live DDP); the classes themselves
# (the roots' subclasses at any depth) are walked again only where a root's count moved (a new
# subclass references every ancestor from its ``__mro__``). Left, as there: a wrapper
# made while other references to its class (and to ``Reducer``) were dropped, the counts
# unchanged, is seen only when they move again. A parameter list whose parameters a
# wrapper made after the handle replaced (fully_shard), without ``module=``, is updated by nobody,
# as a plain optimizer made before fully_shard. The scan is blind to a wrapper ``gc.freeze()`` moved
# to the permanent generation too (``gc.get_referrers`` does not walk it).
#
# Only the parameters a wrapper reduces count: those requiring grad (a DDP over another model
# that shares a frozen layer reduces none of it), and of a DDP those it was not told to ignore
# (``_set_params_and_buffers_to_ignore_for_model``): its private ``_module_parameters``, plus its
# ``_delay_all_reduce_params`` (ignored by name, reduced all the same), read where both are lists
# of tensors (else every parameter, as before); a DDP read so relates to the handle through those
# parameters alone (a DDP replaces none: the module relations are for fully_shard).
#
# The tripwire, independent of the garbage collector: DDP's finalize writes the reduced gradient
# back into ``.grad`` of every parameter it reduced when backward ends, after the handle's update
# freed it (world size 1 too). Each update records the parameters whose ``.grad`` it freed; at the
# next ``step()``, ``zero_grad()`` (the handle's) or a step's first hook, before any change, one of
# them holding a ``.grad`` again is refused ("something wrote .grad after the update: a DDP/FSDP
# reducer?"); once the call goes on, the record is cleared. At world size 1 the update used the
# gradient the reduction gives, so the refusal comes before the stale gradient is applied or added
# to. No legitimate ``.grad`` is there: with ``accumulate=N`` the gradients of a cycle are held in
# ``.grad`` before the update, which frees them, and the record is cleared at the next cycle's
# first hook;
# a backward that raised leaves its gradients held, not freed; the handle never leaves a tensor
# in ``.grad`` between backwards, and a ``.grad`` user code set there (the plain loop would apply
# or add to it, the handle would not) is refused as the DDP's. At a first hook with
# ``accumulate=1`` the parameter whose ``AccumulateGrad`` just ran is not told apart (its ``.grad``
# is this backward's); the refusal drops that gradient with the backward's, as every refusal there.
def _wrapper_roots() -> list[type]:
    roots: list[type] = [torch.nn.parallel.DistributedDataParallel]
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is not None:
        for name in ("FullyShardedDataParallel", "FSDPModule"):
            cls = getattr(fsdp, name, None)
            if isinstance(cls, type):
                roots.append(cls)
    return roots


def _wrapper_classes() -> list[type]:
    # the wrapper classes and their subclasses at any depth, walked again only where a root
    # class's reference count moved (a new subclass references every ancestor from its __mro__;
    # the FSDP roots appear on import); the last walk is held weakly (the key is read with no
    # other reference of this call's alive, as at the next call)
    key = tuple((id(c), _getrefcount(c)) for c in _wrapper_roots())
    if key == _Wrappers.classes_key:
        known = [r() for r in _Wrappers.classes]
        if None not in known:
            return known  # type: ignore[return-value]
    roots, classes = _wrapper_roots(), []
    while roots:
        c = roots.pop()
        if not any(c is k for k in classes):
            classes.append(c)
            roots.extend(c.__subclasses__())
    _Wrappers.classes = [weakref.ref(c) for c in classes]
    _Wrappers.classes_key = key
    return classes


class _Wrappers:
    # NOTE [Parameters a DDP or FSDP reduces]: the last scan, shared by every handle: the classes'
    # (id, reference count) then, weak references to the wrappers it found, and its number
    key: tuple | None = None
    refs: list = []
    scan = 0
    classes_key: tuple | None = None  # _wrapper_classes: the roots' counts, the walk (weakly)
    classes: list = []


# DDP's C++ reducer class (one instance per live DDP), looked up once
_REDUCER = getattr(torch.distributed, "Reducer", None) if torch.distributed.is_available() else None


def _wrapper_died(_: weakref.ref) -> None:
    _Wrappers.key = None  # (a wrapper rebound over a seen one leaves the counts as they were)


def _live_wrappers() -> tuple[int, list[torch.nn.Module]]:
    # NOTE [Parameters a DDP or FSDP reduces]: (the scan's number, the live wrappers)
    classes = _wrapper_classes()
    # (DDP's C++ reducer, one per live DDP: its count moves too, a second witness of a new DDP)
    key = tuple((id(c), _getrefcount(c)) for c in (*classes, _REDUCER) if c is not None)
    if key != _Wrappers.key:
        kinds = tuple(classes)
        _Wrappers.refs = [
            weakref.ref(o, _wrapper_died)
            for o in gc.get_referrers(*kinds)
            if isinstance(o, kinds) and isinstance(o, torch.nn.Module)
        ]
        _Wrappers.scan += 1
        _Wrappers.key = key
    live = [r() for r in _Wrappers.refs]
    return _Wrappers.scan, [w for w in live if w is not None]


def _reduced(w: torch.nn.Module) -> tuple[list[torch.Tensor], bool]:
    # NOTE [Parameters a DDP or FSDP reduces]: the parameters a wrapper reduces: those requiring
    # grad (none reduces a frozen one); for a DDP, of those it was not told to ignore (its private
    # ``_module_parameters``, and ``_delay_all_reduce_params``, ignored by name and reduced all the
    # same), where both are what they were in torch 2.13 (then True: exact, a DDP replaces no
    # parameter); else every parameter
    mine = getattr(w, "_module_parameters", None)
    delayed = getattr(w, "_delay_all_reduce_params", [])
    if (
        isinstance(w, torch.nn.parallel.DistributedDataParallel)
        and isinstance(mine, list)
        and isinstance(delayed, list)
        and all(isinstance(q, torch.Tensor) for q in (*mine, *delayed))
    ):
        params: Iterable[torch.Tensor] = (*mine, *delayed)
        exact = True
    else:
        params, exact = w.parameters(), False
    return [q for q in params if q.requires_grad], exact


def _wrapping(
    live: list[torch.nn.Module], params: Iterable[torch.Tensor], module: torch.nn.Module | None
) -> Exception | None:
    # NOTE [Parameters a DDP or FSDP reduces]: the refusal for the first wrapper that holds one of
    # ``params``, holds ``module`` or sits inside it; None when none does
    if not live:
        return None
    ids = {id(p) for p in params}
    inside = {id(m) for m in module.modules()} if module is not None else set()
    for w in live:
        reduced, exact = _reduced(w)
        held = sum(id(q) in ids for q in reduced)
        kind = type(w).__name__
        if held:
            got = f"{held} of its parameters inside a {kind}"
        elif exact:
            continue  # (a DDP that reduces none of them; the module relations are fully_shard's)
        elif w is module:
            got = f"its module wrapped as a {kind}"
        elif module is not None and id(w) in inside:
            got = f"a {kind} inside the handle's module"
        elif module is not None and any(m is module for m in w.modules()):
            got = f"its module inside a {kind}"
        else:
            continue
        return _err(
            NotImplementedError,
            "parameters that a DistributedDataParallel/FSDP wrapper reduces (any world size); "
            "its reducer takes each gradient after accumulation and writes the reduced one back "
            "into .grad when backward ends, so the update would use the unreduced gradient and "
            "the next backward would add to a stale one",
            "parameters no DDP/FSDP wraps",
            got,
            "Use a plain optimizer with DDP/FSDP (it steps after the reduction), or do not wrap "
            "the model (a single process needs no DDP); to wrap it later, call handle.remove() "
            "first and go on with handle.optimizer",
        )
    return None


def _needs_closure(optimizer_class: type) -> bool:
    try:
        sig = inspect.signature(optimizer_class.step)
    except (TypeError, ValueError):  # pragma: no cover - builtin step
        return False
    p = sig.parameters.get("closure")
    return p is not None and p.default is inspect.Parameter.empty


class StepInBackward(torch.optim.Optimizer):
    """The handle :func:`step_in_backward` returns: an optimizer whose update runs in backward.

    It is a ``torch.optim.Optimizer`` where users touch one: ``param_groups``, ``state``,
    ``defaults``, ``state_dict()``/``load_state_dict()`` (the plain optimizer's format, exchangeable
    with it), ``add_param_group()``, and LR schedulers, which change the ``lr`` the next backward
    uses. ``step()`` and ``zero_grad()`` do nothing to the parameters and mark the end of a step
    (NOTE [What a step is, and what is refused]). ``optimizer`` is the plain optimizer that holds
    the state; ``remove()`` detaches the hooks, after which ``optimizer`` can go on as a plain one.
    The hooks keep the handle alive: dropping the last reference does not detach them.
    Optimizer step hooks, global ones included (``register_optimizer_step_pre_hook``), see one
    ``step()`` of ``optimizer`` per parameter update. ``features_off`` lists ``(name, what is
    off)`` for each private torch query this installation lacks, as ``slimgrad env`` shows them
    (NOTE [A graph task that accumulates nothing]).
    """

    def __init__(
        self,
        params: Any,
        optimizer_class: type,
        optimizer_kwargs: dict[str, Any],
        *,
        accumulate: int = 1,
        clip_grad_norm_per_param: float | None = None,
        clip_grad_value: float | None = None,
        bucket_bytes: int = 1 << 20,
        check_loop: bool = True,
        module: torch.nn.Module | None = None,
    ) -> None:
        # Optimizer.__init__ is not called: param_groups/state/defaults are the plain optimizer's
        # (properties below), so that schedulers and load_state_dict act on the one copy.
        self._optimizer_step_pre_hooks: dict = {}
        self._optimizer_step_post_hooks: dict = {}
        self._optimizer_state_dict_pre_hooks: dict = {}
        self._optimizer_state_dict_post_hooks: dict = {}
        self._optimizer_load_state_dict_pre_hooks: dict = {}
        self._optimizer_load_state_dict_post_hooks: dict = {}
        self._step_supports_amp_scaling = True  # so that GradScaler.step(handle) reaches step()
        self.optimizer: torch.optim.Optimizer = optimizer_class(params, **optimizer_kwargs)
        self._accumulate = accumulate
        self._clip_norm = clip_grad_norm_per_param
        self._clip_value = clip_grad_value
        self._bucket_bytes = bucket_bytes
        self._pending: list[torch.Tensor] = []
        self._pending_bytes = 0
        self._hooks: dict[torch.Tensor, Any] = {}
        # accumulate=N: tensor hooks that run the backward's refusals before AccumulateGrad adds
        # to a gradient of an earlier micro-batch (NOTE [Every refusal changes nothing])
        self._pre_hooks: dict[torch.Tensor, Any] = {}
        # NOTE [Chunked updates]: per parameter whose update by pieces raised after some were
        # applied, the first piece not applied and (weakly) the gradient it is of
        self._pieces_done: dict[torch.Tensor, tuple] = {}
        # NOTE [A graph task that accumulates nothing]: node pre-hooks waiting (no torch query)
        self._deferred: dict[torch.Tensor, Any] = {}
        # the private torch queries this installation lacks (name, what is off), as `slimgrad
        # env` lists them
        self.features_off: tuple[tuple[str, str], ...] = tuple(
            (name, detail) for name, on, detail in _features() if not on
        )
        # NOTE [GradScaler]: the scaler classes' reference counts at the last scan (None: none yet)
        self._scalers_key: tuple | None = None
        self._seen_scalers: list[weakref.ref] = []  # NOTE [GradScaler]
        self._frozen: list[torch.Tensor] = []
        self._group_index: dict[torch.Tensor, int] = {}
        self._position: dict[torch.Tensor, int] = {}  # in its group (NOTE [Small parameters ...])
        self._removed = False
        self._rows_taken: set[torch.Tensor] = set()  # updated by rows in this backward
        # per-parameter hook calls in this step's backward (a second one is refused)
        self._fired: dict[torch.Tensor, int] = {}
        self._task: int | None = None  # graph task of the backward in progress
        self._last_task = -1  # NOTE [A reentrant backward is not a second backward]
        self._resume: Any = None  # the enclosing node's hook that resumes the step (same NOTE)
        # NOTE [A parameter in and around a reentrant checkpoint]: per parameter reached in the
        # backward in progress (accumulate=N): .grad None before it, its _since_zero entry
        self._grad_was: dict[torch.Tensor, tuple] = {}
        self._micro = 0  # backward calls in the current accumulation cycle
        # NOTE [A backward that raised]: the end callback queued last (a freed one of an older
        # token is not this step's), whether this step's backward counted a micro-batch and ran
        # an update, and what a raised one left: _RAISED_HELD/_RAISED_UPDATED, the parameters
        # whose .grad it left, their guards (accumulate=1), and those still to update at the end
        # of the backward that goes on from them (accumulate=1)
        self._end_token = 0
        self._counted = False
        self._updated_now = False
        # NOTE [A backward that raised]: per parameter, (weakly) the gradient the handle clipped in
        # place and its version then, until its update returns; for a raised backward that
        # stopped before its end, what a step() after it applies (warned: held, not reached)
        self._clipped: dict[torch.Tensor, tuple] = {}
        self._raised_partial: tuple[int, int, bool, bool] | None = None
        self._update_raised = False  # an update raised in the step's backward (the same NOTE)
        self._raised = 0
        self._held: list[torch.Tensor] = []
        self._held_hooks: list[Any] = []
        self._late: list[torch.Tensor] = []
        # NOTE [What the loop did since the last update]
        self._check_loop = check_loop
        self._loop = _CLEAN
        self._watch: _ZeroGradWatch | None = None
        # NOTE [Gradients zeroed in place]: the parameters whose .grad the plain loop keeps as a
        # zero tensor (zero_grad(set_to_none=False)), and those that got a gradient since the
        # last zero_grad(); each maps to the sparse_dim of that gradient (None: strided)
        self._held_zero: dict[torch.Tensor, int | None] = {}
        self._since_zero: dict[torch.Tensor, int | None] = {}
        self._outside_module = 0  # handle parameters the watched module does not hold
        # NOTE [Parameters a DDP or FSDP reduces]: the module given (weakly), and the number of
        # the wrapper scan the handle last found clean
        self._module = weakref.ref(module) if module is not None else _no_handle
        self._wrappers_scan = -1
        # the same NOTE: the parameters whose .grad an update freed since the last check (their
        # .grad must stay None until the next backward)
        self._freed: dict[torch.Tensor, None] = {}
        groups = self.optimizer.param_groups
        _check_free([p for g in groups for p in g["params"]])  # before any hook is attached
        for i, group in enumerate(groups):
            self._attach(group["params"], i)
        if check_loop and module is not None:
            self._watch = _ZeroGradWatch(self, module)
            self._watch.count_outside(self)

    # --- what users touch ------------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self):  # type: ignore[override]
        return self.optimizer.state

    @state.setter
    def state(self, value) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def __repr__(self) -> str:
        return f"StepInBackward({self.optimizer!r})"

    def __getstate__(self) -> dict[str, Any]:
        raise _err(
            TypeError,
            "a step_in_backward handle cannot be pickled or copied (it holds autograd hooks)",
            "handle.state_dict()",
            "the handle",
            "Save handle.state_dict() and load it into a new handle or a plain optimizer",
        )

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The plain optimizer's ``state_dict()`` (same format; a plain optimizer loads it)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """The plain optimizer's ``load_state_dict`` (accepts a plain optimizer's state_dict)."""
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:  # type: ignore[override]
        """Add a group (as ``Optimizer.add_param_group``); its parameters update in backward too."""
        self._check_live("add_param_group")
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        _check_params(params)
        _check_free(params)
        refusal = _wrapping(_live_wrappers()[1], params, None)
        if refusal is not None:
            raise refusal
        self.optimizer.add_param_group({**param_group, "params": params})
        self._attach(params, len(self.optimizer.param_groups) - 1)
        if self._watch is not None:
            self._watch.count_outside(self)

    def zero_grad(self, set_to_none: bool = True) -> None:  # type: ignore[override]
        """No-op on the parameters: their gradients were freed in backward. The next backward
        starts a new step (NOTE [What the loop did since the last update]).

        Raises:
            RuntimeError: an accumulation cycle is unfinished (not after a backward that raised:
                NOTE [A backward that raised]); a backward updated the parameters and no
                ``step()`` came since (the plain loop would discard those gradients; they were
                applied in backward).
        """
        self._check_live("zero_grad")
        self._check_freed()
        self._boundary("zero_grad()")
        if self._check_loop:
            self._zeroed("zero_grad()", set_to_none)
        self._freed.clear()

    def step(self, closure: Any = None, **kwargs: Any) -> None:  # type: ignore[override]
        """No-op on the parameters: each was updated in backward. Marks the end of a step (NOTE
        [What the loop did since the last update]); returns None.

        Raises:
            NotImplementedError: a closure (the loss cannot be re-evaluated inside backward), or a
                call from ``torch.amp.GradScaler`` (NOTE [GradScaler]; the handle is left as it
                was), or a live DDP/FSDP wrapper of the handle's parameters or module, or a
                ``.grad`` written after the update freed it (NOTE [Parameters a DDP or FSDP
                reduces]).
            RuntimeError: a second ``step()`` with no backward and no ``zero_grad()`` since the
                last (the plain loop would apply the same gradients again). After fewer than
                ``accumulate`` backward calls, or a backward that raised, ``step()`` updates from
                what ``.grad`` holds, as the plain one (NOTE [A step that ends a cycle early],
                NOTE [A backward that raised]; after a backward that raised in its middle, with a
                ``UserWarning``: only part of the batch is applied).
        """
        self._check_live("step")
        if closure is not None:
            raise _err(
                NotImplementedError,
                "step() got a closure; the update runs in backward and cannot re-evaluate the loss",
                "handle.step() without arguments",
                "a closure",
                "Use a plain optimizer for closure-based steps",
            )
        if kwargs or getattr(self, "grad_scale", None) is not None:
            # GradScaler.step sets these for the call and deletes them only when step() returns
            self.__dict__.pop("grad_scale", None)
            self.__dict__.pop("found_inf", None)
            raise _err(
                NotImplementedError,
                "torch.amp.GradScaler cannot drive step_in_backward; the update runs in backward, "
                "before the scaler can unscale the gradients or skip a step with infs (a scaler "
                "made after the handle's first backward is seen only here, after that backward "
                "updated the parameters)",
                "no GradScaler (bf16 autocast needs none)",
                "a GradScaler step",
                "Use bf16/fp32 without loss scaling, or a plain optimizer with GradScaler",
            )
        self._check_wrappers()
        self._check_freed()
        self._boundary("step()", flush=True)
        if self._check_loop:
            self._stepped()
        self._freed.clear()  # (the updates step() ran freed theirs outside any backward)

    def register_step_pre_hook(self, hook):  # type: ignore[override]
        raise _err(
            NotImplementedError,
            "step hooks do not run (the update happens per parameter in backward)",
            "no step hook on the handle",
            "register_step_pre_hook",
            "Use a post-accumulate-grad hook of your own, or a plain optimizer",
        )

    register_step_post_hook = register_step_pre_hook  # type: ignore[assignment]

    def remove(self) -> None:
        """Detach the hooks. ``handle.optimizer`` (same state) can go on as a plain optimizer;
        the handle's ``step()`` and ``zero_grad()`` raise from now on."""
        for h in (*self._hooks.values(), *self._pre_hooks.values(), *self._deferred.values()):
            h.remove()
        self._pre_hooks.clear()
        self._deferred.clear()
        self._unguard()  # NOTE [A backward that raised]
        for p in self._hooks:
            for attr in (_OWNER, ROW_SINK):
                if getattr(p, attr, None) is not None:
                    delattr(p, attr)
        self._hooks.clear()
        if self._watch is not None:
            self._watch.detach()
            self._watch = None
        self._removed = True

    # --- the hooks -------------------------------------------------------------------------
    def _attach(self, params: list[torch.Tensor], index: int) -> None:
        for k, p in enumerate(params):
            self._group_index[p] = index
            self._position[p] = k
            if p.requires_grad:
                self._hooks[p] = p.register_post_accumulate_grad_hook(self._hook)
                if self._accumulate > 1:
                    self._pre_hooks[p] = p.register_hook(_PreHook(self, p))
                setattr(p, _OWNER, _HandleRef(self))  # NOTE [A handle's marks pickle as none]
                setattr(p, ROW_SINK, _RowSink(self))
            else:
                self._frozen.append(p)

    def _check_live(self, what: str) -> None:
        if self._removed:
            raise _err(
                RuntimeError,
                f"{what}() on a removed handle",
                "a handle before remove()",
                "a removed one",
                "Use handle.optimizer, the plain optimizer with the same state",
            )

    def _check_wrappers(self) -> None:
        # NOTE [Parameters a DDP or FSDP reduces]: before any change
        scan, live = _live_wrappers()
        if scan == self._wrappers_scan:
            return
        refusal = _wrapping(live, self._group_index, self._module())
        if refusal is not None:
            raise refusal
        self._wrappers_scan = scan

    def _check_freed(self, accumulated: torch.Tensor | None = None) -> None:
        # NOTE [Parameters a DDP or FSDP reduces]: before any change, every .grad an update freed
        # since the last call that passed is None still (``accumulated``: the parameter whose
        # AccumulateGrad just ran in this backward, not told apart); the caller clears the record
        # once it changes something
        stale = [p for p in self._freed if p is not accumulated and p.grad is not None]
        if stale:
            n = len(stale)
            raise _err(
                NotImplementedError,
                "something wrote .grad after the update: a DDP/FSDP reducer? (a DDP writes the "
                "reduced gradient back into .grad when backward ends, after the handle applied "
                "the gradient and freed it; the plain loop would apply it or add to it, here it "
                "was applied already)",
                "every .grad the handle freed in its update still None at the next step(), "
                "zero_grad() or backward",
                f"{n} updated parameter{'s' if n != 1 else ''} with a .grad again",
                "Use a plain optimizer with DDP/FSDP (it steps after the reduction), or do not "
                "wrap the model (a single process needs no DDP); code that sets p.grad between "
                "steps: set none (the handle updates from the backward's gradient alone)",
            )

    def _queue_end(self) -> None:
        # NOTE [A backward that raised]: the end callback of the backward running now
        self._end_token += 1
        end = _EndOfBackward(self, self._end_token)
        torch.autograd.Variable._execution_engine.queue_callback(end)

    def _start_backward(self, accumulated: torch.Tensor | None = None) -> int:
        task = torch._C._current_graph_task_id()
        if task == self._task:
            return task
        if self._task is not None:
            # a nested (reentrant) backward inside the one in progress: the same step (NOTE [A
            # reentrant backward is not a second backward])
            if self._accumulate > 1 and not _HAS_NODE_QUERY:
                self._undo_micro()
                raise _reentrant_in_accumulation()
            return task
        if task < self._last_task:
            # NOTE [A reentrant backward is not a second backward]: an enclosing backward goes
            # on after a reentrant one inside it (which ran the handle's first hook) ended
            if self._accumulate > 1:
                self._undo_micro()
                raise _reentrant_in_accumulation()
            self._task = task
            self._queue_end()
            return task
        for p in self._frozen:
            if p.requires_grad:
                raise _err(
                    RuntimeError,
                    "a parameter that was frozen when the handle was made now requires grad",
                    "requires_grad as at step_in_backward()",
                    f"a {tuple(p.shape)} parameter unfrozen",
                    "Call handle.remove() and step_in_backward() again after changing "
                    "requires_grad",
                )
        if _world_size() > 1:
            raise _err(
                NotImplementedError,
                "backward under a process group of several processes; DDP/FSDP or a manual "
                "all-reduce must reduce each gradient before its update",
                "a single process",
                f"world size {_world_size()}",
                "Use a plain optimizer with DDP/FSDP",
            )
        self._check_wrappers()
        self._check_freed(accumulated)
        updates = self._accumulate == 1 or self._micro + 1 == self._accumulate
        if self._check_loop and self._micro == 0:
            self._check_loop_state()
        if updates and _keeps_graph():
            raise _retain_graph_refusal()
        key = _scalers_key()
        if key != self._scalers_key:
            # NOTE [GradScaler]: the first backward, or a scaler class's references changed
            seen = _live_grad_scalers()
            scalers = [o for o in seen if o.is_enabled()]
            if scalers:
                raise _err(
                    NotImplementedError,
                    "a live enabled torch.amp.GradScaler; a scaled loss must have every "
                    "gradient checked for inf/nan before the first update (one inf skips the "
                    "whole step), and this backward updates each parameter as soon as its "
                    "gradient is complete",
                    "no enabled GradScaler (bf16 autocast needs none)",
                    f"{len(scalers)} enabled GradScaler",
                    "Use bf16/fp32 without loss scaling (GradScaler(enabled=False)), or a plain "
                    "optimizer with GradScaler",
                )
            dead = _forget_key(weakref.ref(self))
            self._seen_scalers = [weakref.ref(o, dead) for o in seen]
            self._scalers_key = key
        if self._raised:
            self._go_on_from_raised()
        self._task = task
        self._last_task = task
        self._freed.clear()
        self._fired.clear()
        self._grad_was.clear()
        self._clipped.clear()
        self._updated_now = False
        self._update_raised = False
        self._counted = self._accumulate > 1
        if self._counted:
            self._micro += 1
        self._queue_end()
        return task

    def _check_loop_state(self) -> None:
        # NOTE [What the loop did since the last update]: at the first hook of a backward that
        # starts a step (every one; with accumulate=N the first of a cycle), before any change
        if self._raised == _RAISED_CLIPPED:
            raise _err(
                RuntimeError,
                "a backward after one that raised in an update whose gradients the handle had "
                "clipped in place (clip_grad_norm_per_param/clip_grad_value); the plain loop "
                "would add this backward's gradients to the unclipped ones the raised backward "
                "left and clip the sum, here those were clipped already",
                "step() (applies them clipped once, as the plain loop's clip and step()) or "
                "zero_grad() before the next backward",
                f"a backward after a raised one with {len(self._held)} gradients left",
                "Call handle.step() (then zero_grad()), or handle.zero_grad(), after the error, "
                "before the next backward",
            )
        if self._raised == _RAISED_UPDATED and self._loop == _UPDATED:
            raise _err(
                RuntimeError,
                "a backward after one that raised once it had updated some parameters; the "
                "plain loop would add this backward's gradients to the ones the raised backward "
                "left, here part of those were already applied",
                "step() (applies what the raised backward left, as the plain step()) or "
                "zero_grad() before the next backward",
                f"a backward after a raised one with {len(self._held)} gradients left",
                "Call handle.step() (then zero_grad()) after the error, before the next backward",
            )
        if self._loop == _UPDATED:
            raise _err(
                RuntimeError,
                "a second backward in one step: no step() since the last backward, which "
                "updated the parameters (two losses backward'ed one by one, micro-batch "
                "accumulation, or a loop without step()); the plain loop would sum the gradients "
                "and step once, here each backward would step",
                "step() and zero_grad() between two backward calls",
                f"a second backward after {len(self._fired)} parameters were updated",
                "Backward the summed loss once, use accumulate=N for micro-batches, or call "
                "handle.step() and handle.zero_grad() after each backward (a loop whose every "
                "backward is a whole step on purpose: pass check_loop=False)",
            )
        if self._loop == _STEPPED:
            raise _err(
                RuntimeError,
                "the gradients of the last step were not zeroed: no zero_grad() since step(); "
                "the plain loop would add this backward's gradients to the last step's and step "
                "with their sum, here each backward applies its own",
                "handle.zero_grad(), or zero_grad() of the module given to step_in_backward, "
                "between step() and the next backward",
                "a backward after step() with no zero_grad() seen",
                self._not_zeroed_fix(),
            )

    def _not_zeroed_fix(self) -> str:
        if self._watch is None and self._check_loop:
            # a handle built from parameters or groups sees no module's zero_grad()
            return (
                "The handle was built from parameters, so it sees no model.zero_grad(): pass "
                "module=model to step_in_backward (the module whose zero_grad() the loop calls, "
                "as HF Trainer does), or call handle.zero_grad() after step() (a loop that "
                "zeroes in a way the handle cannot see, e.g. p.grad = None: call it too, or pass "
                "check_loop=False)"
            )
        return (
            "Call handle.zero_grad() after step() (a loop that zeroes in a way the handle "
            "cannot see, e.g. p.grad = None: call it too, or pass check_loop=False)"
        )

    def _end_backward(self) -> None:
        if self._task is None:
            return  # a refusal in this backward ended it already
        node = _enclosing_node()
        if node is not None:
            # NOTE [A reentrant backward is not a second backward]: a nested backward ends
            # inside a node of the enclosing one; the step goes on there (the waiting bucket
            # waits: the enclosing backward may reach one of its parameters again)
            self._resume_on(node)
            return
        self._task = None
        self._rows_taken.clear()
        self._flush()
        if self._late:
            # NOTE [A backward that raised]: gradients a raised backward left that this one did
            # not reach (accumulate=1): the plain step() applies them with this backward's
            late = [p for p in self._late if p.grad is not None]
            self._late = []
            if late:
                self._update(late)
        if self._accumulate > 1:
            if self._micro == self._accumulate:
                # parameters that got a gradient earlier in the cycle but none in its last
                # backward: the plain loop updates them at step()
                late = [
                    p
                    for group in self.optimizer.param_groups
                    for p in group["params"]
                    if p.grad is not None and p in self._hooks
                ]
                if late:
                    self._update(late)
                self._micro = 0

    def _backward_raised(self, partial: bool) -> None:
        # NOTE [A backward that raised]: the engine freed this step's end callback without
        # running it, while the error leaves backward (partial: in its middle; else in the end
        # callback's updates, after every node ran)
        if self._removed:
            return
        self._task = None
        self._rows_taken.clear()
        if self._resume is not None:
            self._resume.remove()
            self._resume = None
        updated = self._updated_now
        self._held = [p for p in self._hooks if p.grad is not None]
        clipped = any(p in self._clipped and self._clipped[p][0]() is p.grad for p in self._held)
        if self._counted:
            # an update ends the cycle (step() applies what is left; so does a gradient clipped
            # for one); otherwise the raised backward does not count
            self._micro = 0 if updated or clipped else self._micro - 1
        self._counted = False
        self._pending, self._pending_bytes = [], 0  # their .grad stays: the plain loop's
        self._late = []
        self._raised = (
            _RAISED_UPDATED
            if updated
            else _RAISED_CLIPPED
            if clipped
            else _RAISED_HELD
            if self._held
            else 0
        )
        # what a step() after it applies: the gradients it made before the error (and the updates
        # it ran), none for the parameters it had not reached yet (warned then)
        missing = sum(p not in self._fired for p in self._hooks)
        self._raised_partial = (
            (len(self._held), missing, updated, self._update_raised)
            if partial and missing and (updated or self._held)
            else None
        )
        self._unguard()
        if self._raised and self._accumulate == 1:
            self._held_hooks = [p.register_hook(_HeldGuard(self, p)) for p in self._held]

    def _unguard(self) -> None:
        for h in self._held_hooks:
            h.remove()
        self._held_hooks = []

    def _go_on_from_raised(self) -> None:
        # NOTE [A backward that raised]: the first backward after a raised one passed the
        # checks: check_loop=False starts each step from no gradient; otherwise the held
        # gradients go on accumulating as in the plain loop (nothing was updated)
        held, self._held, self._raised = self._held, [], 0
        self._raised_partial = None
        self._unguard()
        if not self._check_loop and (self._accumulate == 1 or self._micro == 0):
            for p in held:
                p.grad = None
        elif self._accumulate == 1:
            self._late = held

    def _drop_held(self, apply: bool) -> None:
        # NOTE [A backward that raised]: step() (apply) or zero_grad() after a raised backward
        held, raised, partial = self._held, self._raised, self._raised_partial
        self._held, self._raised, self._raised_partial = [], 0, None
        self._unguard()
        self._micro = 0
        held = [p for p in held if p.grad is not None]
        if apply and partial is not None:
            warnings.warn(_partial_step_warning(*partial), UserWarning, stacklevel=4)
        if apply and held:
            try:
                self._update(held)
            except BaseException:
                # the retry raised too (its update again): what it did not apply is held still,
                # for the next step() or zero_grad()
                self._held = [p for p in held if p.grad is not None]
                self._raised = _RAISED_UPDATED if self._updated_now else raised
                raise
        for p in held:
            p.grad = None

    def _resume_on(self, node: Any) -> None:
        # NOTE [A reentrant backward is not a second backward]: once ``node`` returns, the
        # enclosing backward is the step's backward: its end callback ends the step
        def resume(grad_inputs: Any, grad_outputs: Any) -> None:
            if removable is None or self._resume is not removable:
                return  # a later backward over a retained graph, or a step ended since
            self._resume = None
            removable.remove()
            self._task = torch._C._current_graph_task_id()
            if (self._accumulate == 1 or self._micro == self._accumulate) and _keeps_graph():
                # the enclosing backward keeps its graph: seen only now, after the nested
                # backward's updates (NOTE [Every refusal changes nothing]); loud, not a silent
                # second step over the kept graph
                self._task = None
                raise _retain_graph_refusal()
            self._queue_end()

        removable = None
        removable = node.register_hook(resume)
        self._resume = removable

    def _if_accumulating(self, p: torch.Tensor, fn: Any) -> None:
        # NOTE [A graph task that accumulates nothing]: fn(self, p) before p's AccumulateGrad adds,
        # in a backward that runs it (the step's own task does)
        if torch._C._current_graph_task_id() != self._task:
            node = torch.autograd.graph.get_gradient_edge(p).node
            if not _WILL_EXECUTE:
                self._defer(p, node, fn)
                return
            if not _accumulates(node):
                return
        self._guarded(fn, self, p)

    def _defer(self, p: torch.Tensor, node: Any, fn: Any) -> None:
        # NOTE [A graph task that accumulates nothing], without torch's query: fn(self, p) in a
        # pre-hook of the node, which the engine runs only when it runs the node; one per
        # parameter (a leaf's node is shared by its graphs: one left by a torch.autograd.grad
        # call is replaced, not added to)
        old = self._deferred.pop(p, None)
        if old is not None:
            old.remove()
        handle_ref, p_ref = weakref.ref(self), weakref.ref(p)

        def pre(grad_outputs: Any) -> None:
            removable.remove()
            handle, q = handle_ref(), p_ref()
            if handle is None or q is None or handle._removed:
                return
            if handle._deferred.get(q) is removable:
                del handle._deferred[q]
            handle._guarded(fn, handle, q)

        removable = node.register_prehook(pre)
        self._deferred[p] = removable

    def _before_gradient(self, p: torch.Tensor) -> None:
        # accumulate=N: before AccumulateGrad adds p's gradient
        self._start_backward()
        if p not in self._fired:
            if p not in self._grad_was:
                sz = self._since_zero
                self._grad_was[p] = (p.grad is None, p in sz, sz.get(p))
            return
        # NOTE [A parameter in and around a reentrant checkpoint]: its second gradient in one
        # backward, refused before it is added
        self._undo_micro()
        raise _reentrant_in_accumulation()

    def _undo_micro(self) -> None:
        # NOTE [A parameter in and around a reentrant checkpoint]: a refusal in a micro-batch that
        # updates nothing (not the cycle's last) undoes what this backward did to the cycle
        if not (self._counted and 0 < self._micro < self._accumulate):
            return
        self._micro -= 1
        self._counted = False
        for q in self._fired:
            was_none, in_sz, sd = self._grad_was[q]
            if was_none:
                q.grad = None
            if in_sz:
                self._since_zero[q] = sd
            else:
                self._since_zero.pop(q, None)
        self._fired.clear()
        self._grad_was.clear()

    def _guarded(self, fn, *args) -> Any:
        try:
            return fn(*args)
        except BaseException:
            if self._accumulate == 1 and self._task is not None and not self._updated_now:
                self._refused_before_update()
            raise

    def _refused_before_update(self) -> None:
        # NOTE [Every refusal changes nothing]: accumulate=1, a refusal in a backward that updated
        # nothing yet: each gradient it made was None before it (a parameter's .grad is None
        # between backwards), so it goes, with the record of it; a gradient a raised backward
        # left (NOTE [A backward that raised]) was added to in place and stays, as that one's
        late = set(self._late)
        for p in self._fired:
            if p not in late:
                p.grad = None
                self._since_zero.pop(p, None)
        self._pending, self._pending_bytes = [], 0

    def _hook(self, p: torch.Tensor) -> None:
        try:
            admitted = self._guarded(self._admit, p)
        except BaseException:
            if self._accumulate == 1:
                # NOTE [Every refusal changes nothing]: the gradient this backward accumulated;
                # with accumulate=1 .grad is None when a backward starts
                p.grad = None
            raise
        # the update is not a check: an error in it (an optimizer step pre-hook, an
        # out-of-memory) is a backward that raised, after p's AccumulateGrad ran, and leaves p's
        # gradient in .grad (NOTE [A backward that raised])
        if admitted and (self._accumulate == 1 or self._micro == self._accumulate):
            nbytes = p.numel() * p.element_size()
            if nbytes >= self._bucket_bytes:
                self._update([p])
                return
            # NOTE [Small parameters update together]
            self._pending.append(p)
            self._pending_bytes += nbytes
            if self._pending_bytes >= self._bucket_bytes:
                self._flush()

    def _admit(self, p: torch.Tensor) -> bool:
        # the checks of p's hook, before its update: whether p's gradient is this step's to apply
        task = self._start_backward(p)
        if p in self._rows_taken:
            if p.grad is None:
                return False  # the fused loss returned no gradient for it: its rows are updated
            raise _err(
                RuntimeError,
                "a weight updated row by row in the fused loss's backward got another gradient "
                "in the same backward (a use of it beside the loss, e.g. loss + f(W)); its rows "
                "were already updated without that gradient",
                "the head weight used by the fused loss only",
                f"a second gradient for a {tuple(p.shape)} weight",
                "Add that term inside the model's graph below the loss, or use a plain optimizer",
            )
        self._count(p, task)
        return True

    def _count(self, p: torch.Tensor, task: int) -> None:
        first = self._fired.get(p)
        # with accumulate=N the pre-hook refused a second one (NOTE [A parameter in and around a
        # reentrant checkpoint])
        if self._accumulate == 1 and first is not None:
            if first != task:
                raise self._in_and_around(p)
            # (a second backward is a new graph task: refused at its first hook, or a new step;
            # in one graph task a leaf's AccumulateGrad runs once)
            raise RuntimeError(
                f"{_API}: parameter {self._name(p)} got two gradients in one graph task; this is "
                "a slimgrad bug; please report it"
            )
        self._fired[p] = task
        if self._check_loop:
            self._add_to_held(p)

    def _in_and_around(self, p: torch.Tensor) -> Exception:
        # NOTE [A parameter in and around a reentrant checkpoint], accumulate=1: the two
        # gradients came in two graph tasks of one step, a nested backward and its enclosing one
        return _err(
            NotImplementedError,
            f"parameter {self._name(p)} gets a gradient both inside a reentrant checkpoint "
            "(torch.utils.checkpoint(..., use_reentrant=True): its backward is a nested backward) "
            "and outside it; each gradient arrives complete for its own backward and would be "
            "applied on its own, where the plain loop sums them and steps once (parameters "
            "reached before this one in this backward may be updated already)",
            "every use of a parameter on one side of the checkpoint, or use_reentrant=False",
            f"{self._name(p)} used in and around the checkpointed function",
            "Pass use_reentrant=False to checkpoint (the non-reentrant checkpoint runs one "
            "backward), or keep the parameter's uses on one side of it",
        )

    def _name(self, p: torch.Tensor) -> str:
        module = self._watch.module() if self._watch is not None else None
        if module is not None:
            for name, q in module.named_parameters(remove_duplicate=False):
                if q is p:
                    return f"'{name}' {tuple(p.shape)}"
        return f"of shape {tuple(p.shape)}"

    def _add_to_held(self, p: torch.Tensor) -> None:
        # NOTE [Gradients zeroed in place]: AccumulateGrad wrote this backward's gradient into a
        # .grad that was None; where the plain loop holds a zero tensor, make it what its
        # AccumulateGrad makes (zero + g; g's -0.0 become +0.0), and record the layout
        g = p.grad
        sd = g.sparse_dim() if g is not None and g.layout == torch.sparse_coo else None
        first = p not in self._since_zero
        if not first:
            if sd is None:
                self._since_zero[p] = None  # dense + sparse is dense
            return
        if p in self._held_zero:
            zd = self._held_zero[p]
            if g is not None:
                if zd is None and sd is None:
                    g.add_(0.0)  # 0 + g, bit for bit (IEEE addition commutes)
                elif zd is None:
                    p.grad = torch.zeros_like(p).add_(g)  # dense += sparse
                elif sd is not None:
                    z = _zero_like(p, zd)
                    z += g
                    p.grad = z
                else:
                    p.grad = g + _zero_like(p, zd)  # a sparse .grad plus a dense gradient
            if zd is None:
                sd = None
        self._since_zero[p] = sd

    # --- chunked updates (NOTE [Chunked updates]) --------------------------------------------
    def _chunkable(self, p: torch.Tensor) -> bool:
        opt = self.optimizer
        if (
            type(opt) not in _CHUNKED_OPTIMIZERS
            or p.device.type != "cpu"
            or p.layout != torch.strided
            or p.is_complex()
            or not p.is_contiguous()
        ):
            return False
        group = opt.param_groups[self._group_index[p]]
        if group.get("fused") or group.get("capturable") or group.get("differentiable"):
            return False
        g = p.grad
        if g is not None and (
            g.layout != torch.strided
            or not g.is_contiguous()
            or g.shape != p.shape
            or g.dtype != p.dtype
        ):
            return False
        st = opt.state.get(p)
        if type(opt) is torch.optim.SGD:
            if group["momentum"] != 0 and not (st and torch.is_tensor(st.get("momentum_buffer"))):
                return False  # the first step creates the buffer from the whole gradient
        elif not (st and torch.is_tensor(st.get("step"))):
            return False  # the first step creates the state
        for k, v in (st or {}).items():
            if k == "step":
                continue
            if not (
                torch.is_tensor(v)
                and v.shape == p.shape
                and v.dtype == p.dtype
                and v.device == p.device
                and v.is_contiguous()
            ):
                return False
        return True

    def _update_range(self, p: torch.Tensor, grad: torch.Tensor, a: int, b: int, last: bool):
        # the optimizer's own step() on elements [a, b) of p: views of the parameter, gradient
        # and state; the step counter advances once, in the last piece (the others count from a
        # copy of it)
        opt = self.optimizer
        group = opt.param_groups[self._group_index[p]]
        st = opt.state.get(p, {})  # (no entry is made for a stateless update, as step() makes none)
        with torch.no_grad():
            pv = p.detach().view(-1)[a:b]
            view = {}
            for k, v in st.items():
                if k == "step":
                    view[k] = v if last else v.clone()
                elif torch.is_tensor(v) and v.shape == p.shape:
                    view[k] = v.view(-1)[a:b]
                else:
                    view[k] = v
            pv.grad = grad
            groups, params = opt.param_groups, group["params"]
            opt.state[pv] = view
            try:
                group["params"] = [pv]
                opt.param_groups = [group]
                self._raw_step()
            finally:
                group["params"] = params
                opt.param_groups = groups
                del opt.state[pv]
                pv.grad = None

    def _take_rows(self, p: torch.Tensor, node: Any):
        # called by the fused loss's backward (slimgrad.ops.linear_cross_entropy.ROW_SINK) for an
        # untied head weight: update it block of rows by block of rows, from each block's
        # complete gradient (NOTE [Head gradient by vocabulary blocks] in slimgrad/_math/), or
        # return None and let it come back whole
        if (
            self._removed
            or self._accumulate != 1
            or self._clip_norm is not None
            or p.dim() != 2
            or not _WILL_EXECUTE  # NOTE [A graph task that accumulates nothing]
            or not _accumulates(node)
            or not self._chunkable(p)
            or self._others_hook(p)
        ):
            return None
        task = self._guarded(self._start_backward)
        # NOTE [Gradients zeroed in place]: each block is what the plain loop adds to its zero
        fresh = p not in self._since_zero
        plus_zero = fresh and self._held_zero.get(p, 0) is None
        self._guarded(self._count, p, task)
        self._rows_taken.add(p)
        width, total = p.shape[1], p.shape[0]
        applied = False

        def block(v0: int, v1: int, g: torch.Tensor) -> None:
            # not a check: an error here (an optimizer step pre-hook) is a backward that raised
            # inside the loss's node (NOTE [A backward that raised]); before any block was
            # applied the plain loop's head got no gradient in it
            nonlocal applied
            try:
                if plus_zero:
                    g.add_(0.0)
                if self._clip_value is not None:
                    g.clamp_(min=-self._clip_value, max=self._clip_value)
                self._update_range(p, g.view(-1), v0 * width, v1 * width, v1 == total)
            except BaseException:
                if not applied and fresh:
                    self._since_zero.pop(p, None)
                self._update_raised = True  # (as in _update)
                raise
            applied = True
            self._freed[p] = None  # (a .grad written after its rows were updated is stale)
            self._mark_updated()

        return block

    def _others_hook(self, p: torch.Tensor) -> bool:
        # NOTE [A head weight another hook watches]: a tensor hook or a post-accumulate hook on
        # the head weight that is not this handle's sees (and may change) the weight's whole
        # gradient in the plain loop; the rows taken block by block inside the loss's backward
        # would hand it None (a hook on lm_head.weight got None, and its scaling was lost: the
        # head moved twice as far as the plain loop's; a review). Such a weight's gradient comes
        # back whole, through its hooks, as any parameter's. Where torch keeps no such dicts on
        # the tensor, every weight comes back whole.
        pre = getattr(p, "_backward_hooks", False)
        post = getattr(p, "_post_accumulate_grad_hooks", False)
        if pre is False or post is False:
            return True
        if pre and any(not isinstance(h, _ParamHook) for h in pre.values()):
            return True
        return bool(post) and any(h != self._hook for h in post.values())

    def _flush(self) -> None:
        if self._pending:
            pending = self._pending
            self._pending, self._pending_bytes = [], 0
            self._update(pending)

    def _drop_pending(self) -> None:
        # a backward that raised: its pending gradients are not applied (a refused second
        # backward must leave the parameters as they were)
        for p in self._pending:
            p.grad = None
        self._pending, self._pending_bytes = [], 0

    def _mark_updated(self) -> None:
        # NOTE [What the loop did since the last update]: "updated" once an optimizer step
        # returned, not before it is called (a backward that raised before its bucket flushed, or
        # in an optimizer step pre-hook before anything was applied, updated nothing)
        self._updated_now = True
        if self._check_loop:
            self._loop = _UPDATED

    def _update(self, params: list[torch.Tensor]) -> None:
        try:
            self._apply(params)
        except BaseException:
            # NOTE [A backward that raised]: the error came from an update, where the plain
            # loop's comes at step(), after the whole backward
            self._update_raised = True
            raise

    def _apply(self, params: list[torch.Tensor]) -> None:
        if self._clip_value is not None or self._clip_norm is not None:
            self._clip(params)
        whole = []
        for p in params:
            n = p.numel()
            if n > CHUNK_ELEMS and p.grad is not None and self._chunkable(p):
                # NOTE [Chunked updates]: the optimizer's temporaries are one piece's, not the
                # parameter's (AdamW's sqrt and div of a 94 MiB embedding)
                g = p.grad.view(-1)
                start, grad_ref = self._pieces_done.pop(p, (0, None))
                if grad_ref is None or grad_ref() is not p.grad:
                    start = 0  # (that gradient was dropped since: this one is whole)
                for a in range(start, n, CHUNK_ELEMS):
                    b = min(a + CHUNK_ELEMS, n)
                    try:
                        self._update_range(p, g[a:b], a, b, b == n)
                    except BaseException:
                        # an error in the optimizer (a step pre-hook) after some pieces were
                        # applied: a retried step() applies the rest of this gradient, once
                        # (NOTE [A backward that raised])
                        if a > 0:
                            self._pieces_done[p] = (a, weakref.ref(p.grad))
                        raise
                    self._mark_updated()
                p.grad = None
                self._clipped.pop(p, None)
                self._freed[p] = None
                del g
            else:
                whole.append(p)
        if not whole:
            return
        params = whole
        opt = self.optimizer
        groups = opt.param_groups
        by_group: dict[int, list[torch.Tensor]] = {}
        for p in params:
            by_group.setdefault(self._group_index[p], []).append(p)
        saved = {i: groups[i]["params"] for i in by_group}
        try:
            for i, ps in by_group.items():
                if len(ps) > 1:  # the plain step's order (NOTE [Small parameters update together])
                    ps.sort(key=self._position.__getitem__)
                groups[i]["params"] = ps
            opt.param_groups = [groups[i] for i in sorted(by_group)]
            self._raw_step()
            self._mark_updated()
        finally:
            for i, ps in saved.items():
                groups[i]["params"] = ps
            opt.param_groups = groups
        for p in params:
            p.grad = None
            self._clipped.pop(p, None)
            self._freed[p] = None

    def _clip(self, params: list[torch.Tensor]) -> None:
        # NOTE [A backward that raised]: a gradient clipped in place whose update then raised stays
        # clipped in .grad; the retried step() applies it without clipping it again (the plain
        # loop clips once, then steps). The record stays until the update returns (_update drops
        # it): a retry that raises again leaves it for the next one
        fresh = []
        for p in params:
            done = self._clipped.get(p)
            g = p.grad
            if g is None or done is None or done[0]() is not g or done[1] != g._version:
                fresh.append(p)
        if not fresh:
            return
        if self._clip_value is not None:
            torch.nn.utils.clip_grad_value_(fresh, self._clip_value)
        if self._clip_norm is not None:
            for p in fresh:
                torch.nn.utils.clip_grad_norm_([p], self._clip_norm)
        for p in fresh:
            g = p.grad
            if g is not None:
                self._clipped[p] = (weakref.ref(g), g._version)

    def _raw_step(self) -> None:
        # Optimizer.step's class-level wrapper (profiler record_function, step hooks) costs about
        # as much as a small parameter's whole update; per parameter it would be paid N times.
        # Without step hooks, call the function it wraps (the same update, bit for bit).
        opt = self.optimizer
        raw = getattr(type(opt).step, "__wrapped__", None)
        if (
            raw is None
            or "step" in opt.__dict__
            or opt._optimizer_step_pre_hooks
            or opt._optimizer_step_post_hooks
            or _optim_mod._global_optimizer_pre_hooks
            or _optim_mod._global_optimizer_post_hooks
        ):
            opt.step()
        else:
            raw(opt)

    def _boundary(self, call: str, flush: bool = False) -> None:
        if torch._C._current_graph_task_id() != -1:
            raise _err(
                RuntimeError,
                f"{call} inside backward",
                f"{call} after backward returns",
                "a call from a backward hook",
                f"Call {call} after loss.backward()",
            )
        self._task = None  # outside backward: a backward that raised left no callback to run
        if self._resume is not None:  # an enclosing backward that raised before resuming
            self._resume.remove()
            self._resume = None
        self._rows_taken.clear()
        if self._raised:
            # NOTE [A backward that raised]: the plain step() applies the gradients it left, the
            # plain zero_grad() drops them (mid-cycle too); either ends the cycle
            self._drop_held(apply=flush)
        elif flush and self._micro == 0:
            self._flush()  # (an end callback that never ran: NOTE [A backward that raised])
        self._drop_pending()
        if self._accumulate > 1:
            if 0 < self._micro < self._accumulate and call == "step()":
                # NOTE [A step that ends a cycle early]: the plain step() applies what .grad holds
                self._micro = 0
                held = [
                    p
                    for group in self.optimizer.param_groups
                    for p in group["params"]
                    if p.grad is not None and p in self._hooks
                ]
                if held:
                    self._update(held)
            if self._micro != 0:
                raise _err(
                    RuntimeError,
                    f"{call} in the middle of an accumulation cycle",
                    f"accumulate={self._accumulate} backward calls per step",
                    f"{self._micro}",
                    f"Call {call} after every {self._accumulate} backward calls (or pass the "
                    "accumulate= your loop uses)",
                )

    def _stepped(self) -> None:
        # NOTE [What the loop did since the last update]: step() after the checks of _boundary
        if self._loop == _STEPPED:
            raise _err(
                RuntimeError,
                "a second step() with no backward and no zero_grad() since the last one; the "
                "plain loop would apply the same gradients again, and they were freed in "
                "backward",
                "one step() per backward, then zero_grad()",
                "a second step()",
                "Call step() once per backward and zero_grad() after it",
            )
        # NOTE [Gradients zeroed in place]: the plain step() updates every parameter whose .grad
        # is a zero tensor and got nothing since (momentum, weight decay, Adam's moments)
        idle = [p for p in self._held_zero if p not in self._since_zero and p in self._hooks]
        if idle:
            loop = self._loop
            for p in idle:
                p.grad = _zero_like(p, self._held_zero[p])
            try:
                self._update(idle)
            finally:
                self._loop = loop
                for p in idle:
                    p.grad = None
        if self._loop == _UPDATED:
            self._loop = _STEPPED

    def _zeroed(self, call: str, set_to_none: bool) -> None:
        # NOTE [What the loop did since the last update]: zero_grad() (the handle's or the
        # module's) after the checks of _boundary
        if set_to_none:
            self._held_zero.clear()
        else:  # NOTE [Gradients zeroed in place]: what had a gradient keeps a zero one
            self._held_zero.update(self._since_zero)
        self._since_zero.clear()
        if self._loop == _UPDATED:
            self._loop = _CLEAN
            raise _err(
                RuntimeError,
                f"{call} after a backward that updated the parameters and before step(); the "
                "plain loop would discard these gradients and its step() would change nothing, "
                "here they were applied in backward (this refusal comes after that change)",
                "zero_grad() before backward or after step()",
                f"{call} between backward and step()",
                "Call step() before zero_grad()",
            )
        self._loop = _CLEAN


def _check_free(params: list) -> None:
    for p in params:
        if _owner(p) is not None:
            raise _err(
                RuntimeError,
                "a parameter is already updated in backward by another step_in_backward handle",
                "each parameter in one live handle",
                f"a {tuple(p.shape)} parameter held twice",
                "Call remove() on the other handle first",
            )


def _check_params(params: list) -> None:
    for p in params:
        if isinstance(p, torch.Tensor) and _is_dtensor(p):
            raise _err(
                NotImplementedError,
                "DTensor parameters (FSDP2/tensor parallel) need their gradients reduced before "
                "the update",
                "plain tensors",
                "a DTensor",
                "Use a plain optimizer with FSDP",
            )


def step_in_backward(
    model_or_params: torch.nn.Module | Iterable[torch.Tensor] | Iterable[dict[str, Any]],
    optimizer_class: type[torch.optim.Optimizer],
    /,
    *,
    accumulate: int = 1,
    clip_grad_norm_per_param: float | None = None,
    clip_grad_value: float | None = None,
    bucket_bytes: int = 1 << 20,
    check_loop: bool = True,
    module: torch.nn.Module | None = None,
    **optimizer_kwargs: Any,
) -> StepInBackward:
    """Run the optimizer's update of each parameter inside backward, then free its gradient.

    The parameters after each step equal, bit for bit, those of the plain loop
    ``loss.backward(); opt.step(); opt.zero_grad()`` with ``opt = optimizer_class(params,
    **optimizer_kwargs)``, for any ``torch.optim`` optimizer that takes no closure; tied weights
    update once, from the summed gradient; frozen parameters and parameters without a gradient in
    a step are left alone (NOTE [Why the update is exact]). Keep ``opt.step()`` and
    ``opt.zero_grad()`` (or ``model.zero_grad()`` on the module given here) in the loop: both are
    no-ops on the parameters that the handle follows, and it refuses, before any change, a
    backward the plain loop would treat otherwise: a second one with no ``step()`` since the last,
    one after ``step()`` with no ``zero_grad()`` (NOTE [What the loop did since the last update];
    ``check_loop=False`` for a loop whose every backward is a whole step). Every refusal comes
    before anything changes (parameters, optimizer state, ``.grad``, schedulers; NOTE [Every
    refusal changes nothing] lists the few late ones).

    Not supported, refused before the first update: ``torch.amp.GradScaler`` (a skipped step
    needs every gradient checked before the first update; an enabled scaler alive at the handle's
    first backward refuses it, NOTE [GradScaler]) and ``backward(retain_graph=True)``/
    ``create_graph=True`` in a backward that updates. Global-norm clipping
    (``torch.nn.utils.clip_grad_norm_``, on by default in HF Trainer) silently clips nothing after
    backward, since every gradient is freed, and cannot be detected without patching torch: use
    ``clip_grad_norm_per_param`` or ``clip_grad_value`` instead and turn the loop's clip off.

    Memory: the gradients alive at once are those produced by one autograd node (a layer's weight
    and bias) plus at most ``bucket_bytes`` of small parameters' gradients waiting for their
    update, not every parameter's as in the plain loop; with ``accumulate=N`` every gradient
    stays until the last micro-batch (no saving over the plain loop, exactness only).

    Args:
        model_or_params: a module (its ``parameters()``), an iterable of parameters, or of param
            group dicts, as ``torch.optim`` optimizers take.
        optimizer_class: a ``torch.optim.Optimizer`` subclass, e.g. ``torch.optim.AdamW``.
        accumulate: backward calls per step (micro-batch gradient accumulation): gradients
            accumulate as in the plain loop and each parameter updates in the last one; parameters
            that got a gradient only in earlier micro-batches update at the end of the last
            backward; a ``step()`` after fewer backward calls (the end of an epoch) updates from
            what they accumulated, as the plain ``step()``.
        clip_grad_norm_per_param: clip each gradient by its own norm before the update (the plain
            loop's ``for p in params: clip_grad_norm_([p], c)``); global-norm clipping is
            impossible here.
        clip_grad_value: clamp each gradient to ``[-c, c]`` (exactly the plain loop's
            ``clip_grad_value_(params, c)``).
        bucket_bytes: parameters smaller than this wait, up to this many gradient bytes
            together, and update in one optimizer call (NOTE [Small parameters update
            together]); 0: every parameter updates alone, as soon as its gradient is complete.
        check_loop: follow ``step()``/``zero_grad()`` (the handle's, and the given module's
            ``zero_grad()``) and refuse a backward the plain loop would treat otherwise (default).
            False: every backward (every ``accumulate`` backward calls) is one whole step,
            ``zero_grad(); backward(); step()``, unchecked: for a loop that zeroes where the
            handle cannot see it (``p.grad = None``) or calls no ``step()``.
        module: for a handle built from parameters or param groups: the module whose
            ``zero_grad()`` the loop calls (HF Trainer's ``model.zero_grad()``); it must hold
            every parameter given. Its ``zero_grad()`` then counts as ``handle.zero_grad()``
            (without it such a loop is refused as one that never zeroes). A module handle watches
            its own module.
        **optimizer_kwargs: the optimizer's keyword arguments (``lr=``, ``weight_decay=``, ...).

    Returns:
        A :class:`StepInBackward` handle (a ``torch.optim.Optimizer``: schedulers, ``state_dict``,
        ``load_state_dict`` work on it). ``handle.remove()`` detaches the hooks.

    Raises:
        TypeError: ``optimizer_class`` is not an Optimizer class; a bad ``accumulate``,
            ``check_loop`` or ``module``.
        ValueError: ``accumulate`` < 1; a negative clip; ``module=`` that does not hold every
            parameter, or beside another module.
        NotImplementedError: a DDP/FSDP-wrapped module, parameters (or a module) that a live
            DDP/FSDP wrapper holds at any world size, DTensor parameters, a process group of
            more than one process, an optimizer whose step needs a closure (LBFGS). In a later
            backward (or ``step()``): a live enabled GradScaler, ``retain_graph``/
            ``create_graph``, several processes, a DDP/FSDP wrapper made after the handle, a
            ``.grad`` written after the update freed it (a reducer the wrapper scan missed), a
            parameter used inside and outside a reentrant checkpoint.
        RuntimeError: a parameter already holds a gradient, or is held by another handle. In a
            later backward: a second backward with no ``step()`` since the last, a backward after
            ``step()`` with no ``zero_grad()``, a frozen parameter unfrozen, a backward after
            one that raised once it had updated or clipped a gradient in place (call ``step()``
            first: NOTE [A backward that raised]).

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = step_in_backward(model, torch.optim.SGD, lr=0.1, momentum=0.9)
        >>> model(torch.randn(3, 4)).sum().backward()  # updated; model.weight.grad is None
        >>> opt.step(); opt.zero_grad()  # no-ops that mark the end of the step
    """
    if not (
        isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)
    ):
        got = (
            f"an instance of {type(optimizer_class).__name__}"
            if isinstance(optimizer_class, torch.optim.Optimizer)
            else repr(optimizer_class)
        )
        raise _err(
            TypeError,
            "optimizer_class must be an optimizer class",
            "a torch.optim.Optimizer subclass, e.g. torch.optim.AdamW",
            got,
            "Pass the class and its keyword arguments: "
            "step_in_backward(model, torch.optim.AdamW, lr=1e-3)",
        )
    if issubclass(optimizer_class, StepInBackward):
        raise _err(
            TypeError,
            "optimizer_class is slimgrad's own handle class",
            "a torch.optim optimizer class",
            "StepInBackward",
            "Pass the optimizer class, e.g. torch.optim.AdamW",
        )
    if _needs_closure(optimizer_class):
        raise _err(
            NotImplementedError,
            f"{optimizer_class.__name__}.step needs a closure that re-evaluates the loss, which "
            "cannot run inside backward",
            "an optimizer whose step(closure=None) works without a closure",
            optimizer_class.__name__,
            "Use a plain optimizer loop for closure-based optimizers",
        )
    if isinstance(accumulate, bool) or not isinstance(accumulate, int):
        raise _err(
            TypeError,
            "accumulate must be an int",
            "an int >= 1",
            type(accumulate).__name__,
            "Pass the number of backward calls per step, e.g. accumulate=4",
        )
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 0:
        raise _err(
            ValueError,
            "bucket_bytes must be a non-negative int",
            "an int >= 0 (0: every parameter updates alone)",
            repr(bucket_bytes),
            "Pass e.g. bucket_bytes=1 << 20",
        )
    if not isinstance(check_loop, bool):
        raise _err(
            TypeError,
            "check_loop must be a bool",
            "True (follow step()/zero_grad()) or False (every backward is a whole step)",
            repr(check_loop),
            "Pass check_loop=True or check_loop=False",
        )
    if module is not None and not isinstance(module, torch.nn.Module):
        raise _err(
            TypeError,
            "module must be a torch.nn.Module",
            "the model whose zero_grad() the loop calls, or None",
            type(module).__name__,
            "Pass module=model",
        )
    if isinstance(model_or_params, torch.nn.Module) and module not in (None, model_or_params):
        raise _err(
            ValueError,
            "module= names another module than the one the handle is built from",
            "module= only with parameters or param groups (a module handle watches itself)",
            f"a {type(module).__name__} beside a {type(model_or_params).__name__}",
            "Drop module=, or build the handle from that module's parameters",
        )
    if accumulate < 1:
        raise _err(
            ValueError,
            "accumulate must be at least 1",
            "an int >= 1",
            str(accumulate),
            "Pass the number of backward calls per step, e.g. accumulate=4",
        )
    for name, c in (
        ("clip_grad_norm_per_param", clip_grad_norm_per_param),
        ("clip_grad_value", clip_grad_value),
    ):
        if c is not None and not c >= 0:
            raise _err(
                ValueError,
                f"{name} must be a non-negative number",
                ">= 0 or None",
                repr(c),
                f"Pass a non-negative {name}",
            )
    if isinstance(model_or_params, torch.nn.Module):
        dist = _dist_classes()
        for name, m in model_or_params.named_modules():
            if isinstance(m, dist):
                raise _err(
                    NotImplementedError,
                    f"a {type(m).__name__}-wrapped module ({name or 'the model'}); its gradients "
                    "are reduced across processes after accumulation and must be before the update",
                    "a module without DDP/FSDP",
                    type(m).__name__,
                    "Use a plain optimizer with DDP/FSDP",
                )
        # (no reference to the wrapper classes left: their counts key the scan, NOTE [Parameters a
        # DDP or FSDP reduces])
        del dist
        params: Any = list(model_or_params.parameters())
    elif isinstance(model_or_params, torch.Tensor):
        params = [model_or_params]
    else:
        params = list(model_or_params)
    if params and isinstance(params[0], dict):
        # each group's params listed once (a generator, e.g. module.parameters(), is read once)
        params = [
            {
                **g,
                "params": [g["params"]]
                if isinstance(g.get("params"), torch.Tensor)
                else list(g.get("params", [])),
            }
            if isinstance(g, dict)
            else g
            for g in params
        ]
    flat: list = []
    for item in params:
        if isinstance(item, dict):
            flat.extend(item["params"])
        else:
            flat.append(item)
    _check_params(flat)
    with_grad = [p for p in flat if isinstance(p, torch.Tensor) and p.grad is not None]
    if with_grad:
        raise _err(
            RuntimeError,
            "parameters already hold gradients; the first backward would add to them",
            "every .grad None",
            f"{len(with_grad)} parameters with a .grad",
            "Call model.zero_grad(set_to_none=True) (or your optimizer's zero_grad()) first",
        )
    if _world_size() > 1:
        raise _err(
            NotImplementedError,
            "a process group of several processes is initialised; DDP/FSDP or a manual "
            "all-reduce must reduce each gradient before its update",
            "a single process",
            f"world size {_world_size()}",
            "Use a plain optimizer with DDP/FSDP",
        )
    refusal = _wrapping(
        _live_wrappers()[1],
        [p for p in flat if isinstance(p, torch.Tensor)],
        model_or_params if isinstance(model_or_params, torch.nn.Module) else module,
    )
    if refusal is not None:  # NOTE [Parameters a DDP or FSDP reduces]
        raise refusal
    if isinstance(model_or_params, torch.nn.Module):
        module = model_or_params
    elif module is not None:
        # the module whose zero_grad() the loop calls, for a handle built from parameters or
        # groups (NOTE [What the loop did since the last update]); it must hold them all
        held = {id(q) for q in module.parameters()}
        outside = [p for p in flat if isinstance(p, torch.Tensor) and id(p) not in held]
        if outside:
            raise _err(
                ValueError,
                "module= must hold every parameter given to the handle (its zero_grad() zeroes "
                "them all)",
                "the model the parameters or groups come from",
                f"{len(outside)} of {len(flat)} parameters outside it",
                "Pass module=model, the module whose zero_grad() the loop calls",
            )
    return StepInBackward(
        params,
        optimizer_class,
        optimizer_kwargs,
        accumulate=accumulate,
        clip_grad_norm_per_param=clip_grad_norm_per_param,
        clip_grad_value=clip_grad_value,
        bucket_bytes=bucket_bytes,
        check_loop=check_loop,
        module=module,
    )


def _partial_step_warning(held: int, missing: int, updated: bool, in_update: bool) -> str:
    # NOTE [A backward that raised]: step() after a backward that raised in its middle
    ran = ", after the updates it ran in backward" if updated else ""
    plain = (
        "unlike the plain loop, whose error comes after the whole backward"
        if in_update
        else "as the plain loop's step() after the same error"
    )
    grads = "gradient" if held == 1 else "gradients"
    params = (
        "parameter it had not reached gets" if missing == 1 else "parameters it had not reached get"
    )
    return (
        f"{_API}: step() after a backward that raised in its middle applies only what that "
        f"backward made before the error: the {held} {grads} it left in .grad{ran}; the "
        f"{missing} {params} nothing from that batch ({plain}); expected a step after a whole "
        "backward, got one after a backward that raised. Call zero_grad() instead of step() to "
        "drop the partial batch (then run it again), or filter this warning where the partial "
        "update is intended."
    )


def _reentrant_in_accumulation() -> NotImplementedError:
    # the refusal _start_backward raises for a reentrant backward in an accumulate=N cycle, met
    # either inside the outer backward's first hook or when the outer one goes on after it
    return _err(
        NotImplementedError,
        "a reentrant backward (torch.utils.checkpoint with use_reentrant=True) inside "
        "an accumulate=N backward; the micro-batch count would be wrong",
        "use_reentrant=False",
        "a nested backward",
        "Pass use_reentrant=False to checkpoint",
    )


def _retain_graph_refusal() -> NotImplementedError:
    return _err(
        NotImplementedError,
        "backward(retain_graph=True) (or create_graph=True) in a backward that updates "
        "the parameters; the update writes them in place, so a second backward over the "
        "kept graph would read updated parameters (autograd's version check) or step "
        "twice",
        "retain_graph=False",
        "a backward that keeps its graph (retain_graph=True or create_graph=True)",
        "Backward the summed loss once without retain_graph (or use a plain optimizer "
        "for double backward)",
    )
