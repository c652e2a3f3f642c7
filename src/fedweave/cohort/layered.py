"""The fast path of a cohort for chains of Linear layers and elementwise activations (MLPs).

A model whose forward is a chain of ``Linear``, ``Flatten`` and elementwise activations (the
built-in MLP without dropout; what :func:`chain_of` finds by tracing it with ``torch.fx``) needs
no ``vmap``: for K clients at once each Linear is one batched product of the stacked parameters,
``[K, B, in] x [K, in, out]`` (``torch.baddbmm``), and its backward is written out, two more
batched products (``grad W = g^T h``, ``grad h = g W``) and a sum for the bias, each activation's
backward the kernel autograd itself calls (``threshold_backward`` for ReLU, ...). A handful of
operations per layer whatever K, instead of ``vmap``'s batching rules and an autograd graph. The
loss is each client's mean over its real rows (``weight``: 1 / the batch's count on real rows, 0 on
padding), so each client's slice of the gradient is its own; cross-entropy's gradient is written
out too, any other per-example loss goes through autograd from the outputs on.

Each client's result has the same bits whatever the other clients of its group, its place there
and the number of threads, on a CPU, for input and hidden widths that are multiples of 8 (others
MKL sums by the matrix's place in a batch, to rounding): a batched product computes each client's product as it
computes it alone, one thread each (:func:`_product` gives a batch of one product one thread too:
MKL would split a lone product over the threads), except a product of or into a vector, which MKL
sums by the matrix's place in the batch and :func:`_product` writes out as a reduction; the bias gradient is each client's own sum
over its batch (a matrix-vector product over every client's rows at once would sum by other blocks
with another number of clients); and the caller pads the batches to a width of the client's own, a
multiple of 8 (:func:`fedweave.cohort.trainer.batch_width`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx
from torch import nn

from fedweave.cohort.optim import Workspace

Activation = tuple[
    Callable[[torch.Tensor], torch.Tensor],
    Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    Callable[[torch.Tensor], torch.Tensor] | None,
]
"""An activation's forward, its backward ``(grad of output, input, output) -> grad of input``, and
its forward in place where its backward reads the output alone (ReLU, tanh, sigmoid: the input may
then be overwritten), else None."""

aten = torch.ops.aten


def _activation(module: nn.Module) -> Activation | None:
    """The forward and backward of an elementwise activation module, or None."""
    if type(module) is nn.ReLU:
        return torch.relu, lambda g, _x, y: aten.threshold_backward(g, y, 0), torch.relu_
    if type(module) is nn.Tanh:
        return torch.tanh, lambda g, _x, y: aten.tanh_backward(g, y), torch.tanh_
    if type(module) is nn.Sigmoid:
        return torch.sigmoid, lambda g, _x, y: aten.sigmoid_backward(g, y), torch.sigmoid_
    if type(module) is nn.GELU:
        approximate = module.approximate
        return (lambda x: nn.functional.gelu(x, approximate=approximate),
                lambda g, x, _y: aten.gelu_backward(g, x, approximate=approximate), None)
    if type(module) is nn.SiLU:
        return nn.functional.silu, lambda g, x, _y: aten.silu_backward(g, x), None
    if type(module) is nn.LeakyReLU:
        slope = module.negative_slope
        return (lambda x: nn.functional.leaky_relu(x, slope),
                lambda g, x, _y: aten.leaky_relu_backward(g, x, slope, False), None)
    return None


@dataclass(frozen=True)
class Layer:
    """One link of the chain: a Linear (``name``: its parameters' prefix, ``bias`` whether it has
    one), an activation, or a flatten of each example."""

    kind: str  # "linear" | "activation" | "flatten"
    name: str = ""
    bias: bool = False
    activation: Activation | None = None


_CHAINS: weakref.WeakKeyDictionary[nn.Module, tuple[torch.Size, list[Layer] | None]] = weakref.WeakKeyDictionary()


def chain_of(model: nn.Module, example: torch.Tensor) -> list[Layer] | None:
    """:func:`trace_chain` of ``model``, traced once per model and shape of an input row."""
    known = _CHAINS.get(model)
    if known is None or known[0] != example.shape:
        known = _CHAINS[model] = (example.shape, trace_chain(model, example))
    return known[1]


def trace_chain(model: nn.Module, example: torch.Tensor) -> list[Layer] | None:
    """The model's forward as a chain of :class:`Layer`, or None when it is not one: every
    parameter trainable, no buffer, and the traced forward a chain of Linear, ``Flatten()`` (all but
    the batch dimension) and the activations above, each Linear fed one row per example
    (``example``: one input row)."""
    if any(not p.requires_grad for p in model.parameters()) or any(True for _ in model.buffers()):
        return None
    try:
        graph = torch.fx.symbolic_trace(model).graph
    except Exception:  # a forward fx cannot trace (data-dependent control flow): not a chain
        return None
    modules = dict(model.named_modules())
    layers: list[Layer] = []
    previous: torch.fx.Node | None = None
    flat = example.dim() == 1
    for node in graph.nodes:
        if node.op == "placeholder":
            if previous is not None:
                return None
            previous = node
            continue
        if node.op == "output":
            return layers if node.args == (previous,) and any(layer.kind == "linear" for layer in layers) else None
        if node.op != "call_module" or node.args != (previous,) or node.kwargs:
            return None
        module = modules[node.target]
        if type(module) is nn.Linear:
            if not flat:
                return None
            layers.append(Layer("linear", node.target, module.bias is not None))
        elif type(module) is nn.Flatten:
            if (module.start_dim, module.end_dim) != (1, -1):
                return None
            layers.append(Layer("flatten"))
            flat = True
        elif (act := _activation(module)) is not None:
            layers.append(Layer("activation", activation=act))
        else:
            return None
        previous = node
    return None


LossGrad = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``(outputs [K, O, B], targets [K, B, ...], weight [K, 1, B], losses [K, 1, B]) -> grad of outputs
[K, O, B]``, outputs features first, as :class:`ChainGradients` computes them: each row's loss is
written into ``losses`` (a client's task loss is then ``Σ weight * losses`` over its rows, which
the caller sums when it needs it, not at every step) and the gradient is that of the task losses."""


def cross_entropy_grad() -> LossGrad:
    """Cross-entropy on logits and the gradient of each client's weighted sum of it over its rows:
    ``(softmax - one_hot) * weight``, what autograd's log-softmax and NLL backward compute (the
    caller gives weight 0 to a target that is ``ignore_index``)."""
    minus_ones: dict[tuple, torch.Tensor] = {}  # what scatter_add_ adds at each target, per shape

    def loss_grad(out: torch.Tensor, target: torch.Tensor, weight: torch.Tensor, losses: torch.Tensor) -> torch.Tensor:
        index = target.unsqueeze(1)
        logp = out.log_softmax(1)
        torch.gather(logp, 1, index, out=losses).neg_()
        grad = logp.exp_()
        key = (index.shape, grad.dtype, grad.device)
        ones = minus_ones.get(key)
        if ones is None:
            ones = minus_ones[key] = torch.full((1, 1, 1), -1, dtype=grad.dtype, device=grad.device).expand(index.shape)
        grad.scatter_add_(1, index, ones)
        return grad.mul_(weight)

    return loss_grad


def autograd_loss_grad(per_example: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> LossGrad:
    """Any per-example loss (``per_example(outputs [N, O], targets [N, ...]) -> [N]``), its
    gradient by autograd from the outputs on."""

    def loss_grad(out: torch.Tensor, target: torch.Tensor, weight: torch.Tensor, losses: torch.Tensor) -> torch.Tensor:
        K, _, B = weight.shape
        leaf = out.transpose(1, 2).detach().requires_grad_()
        with torch.enable_grad():
            each = per_example(leaf.reshape(K * B, -1), target.reshape(K * B, *target.shape[2:])).view(K, B)
            (grad,) = torch.autograd.grad((each * weight.view(K, B)).sum(), [leaf])
        losses.view(K, B).copy_(each.detach())
        return grad.transpose(1, 2)

    return loss_grad


def task_losses(losses: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Each client's task loss from its rows' ``losses`` and ``weight`` (``[..., K, 1, B]`` both):
    ``[..., K]``."""
    return (losses * weight).sum((-2, -1))


def _product(
    a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None = None, beta: float = 1.0, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Each client's ``a @ b`` (``[K, M, k] x [K, k, N]``), plus ``beta * c`` where given (a bias
    column, or ``out`` itself: a momentum buffer), into ``out`` where given, with the bits the
    client's product has alone: a batched product (``bmm``, ``baddbmm``), on one thread for a batch
    of one (MKL would split a lone product over the threads and sum otherwise than it sums the same
    product in a batch, one thread each), but where a client's product is of or into a vector (M or
    N 1) its sums written out as a reduction, since MKL's batched product sums such a product by the
    matrix's place in the batch."""
    if a.shape[1] == 1 or b.shape[2] == 1:
        value = (a.unsqueeze(3) * b.unsqueeze(1)).sum(2)
        if c is not None:
            value.add_(c, alpha=beta)
        return value if out is None else out.copy_(value)
    threads = torch.get_num_threads()
    if a.shape[0] == 1 and threads > 1:
        torch.set_num_threads(1)
        try:
            return _product(a, b, c, beta, out)
        finally:
            torch.set_num_threads(threads)
    if c is None:
        return torch.bmm(a, b, out=out)
    return c.baddbmm_(a, b, beta=beta) if out is c else torch.baddbmm(c, a, b, beta=beta)


class ChainGradients:
    """Each client's gradient of its task loss over a chain of :class:`Layer` and the stacked
    ``params`` (updated in place between calls): the chain's forward, then its backward by hand.
    The views of the first ``a`` clients' parameters are made once per ``a``; the weights' gradients
    are written into tensors of ``workspace``, the same at every call (the caller uses them before
    the next)."""

    def __init__(self, layers: list[Layer], params: dict[str, torch.Tensor], loss_grad: LossGrad,
                 workspace: Workspace | None = None):
        self.layers = layers
        self.params = params
        self.loss_grad = loss_grad
        self.workspace = Workspace() if workspace is None else workspace  # the weights' gradients, reused
        self.first = next(i for i, layer in enumerate(layers) if layer.kind == "linear")  # no gradient of the input
        # each activation's forward: in place right after a Linear, whose output is the call's own tensor, read by
        # no backward (where the activation's backward reads its output alone), else out of place
        self._forwards = {
            i: act[2] if act[2] is not None and i > 0 and layers[i - 1].kind == "linear" else act[0]
            for i, layer in enumerate(layers) if (act := layer.activation) is not None
        }
        self._views: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]] = {}

    def _prefix(self, a: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """Per Linear, the first ``a`` clients' weight, its transpose and the bias as a column."""
        views = self._views.get(a)
        if views is None:
            views = self._views[a] = [
                (w := self.params[layer.name + ".weight"][:a], w.transpose(1, 2),
                 self.params[layer.name + ".bias"][:a].unsqueeze(2) if layer.bias else None)
                for layer in self.layers if layer.kind == "linear"
            ]
        return views

    def __call__(
        self, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, losses: torch.Tensor,
        into: tuple[dict[str, torch.Tensor], float | None] | None = None,
    ) -> dict[str, torch.Tensor]:
        """The gradients (a dict like ``params``) of the first K clients' task losses, ``x``
        [K, B, ...] their batches, ``weight`` [K, 1, B] each row's weight in its client's loss;
        each row's loss is written into ``losses`` [K, 1, B] (:data:`LossGrad`, :func:`task_losses`).
        With ``into`` (``(buffers, beta)``, buffers of the first K clients by parameter name), each
        gradient is added into its buffer instead, ``buffer = beta * buffer + gradient`` (beta None:
        ``buffer = gradient``), a weight's in its batched product (``baddbmm_``), and the buffers
        are returned (SGD's momentum: :meth:`~fedweave.cohort.optim.StackedOptimizer.momentum_buffers`).

        Activations are kept features first, ``[K, features, B]`` (``W h`` with ``W`` as stored is
        the faster product on a CPU); ``Flatten`` is applied to the input once, up front: the
        activations are elementwise, and after a Linear each example is one row already (a batch
        given flat, ``[K, B, features]``, is read as it is: the first Linear's weight gradient
        takes its rows as they lie)."""
        K, _, B = weight.shape
        views = self._prefix(K)
        rows = x if x.dim() == 3 else x.reshape(K, B, -1)
        h = start = rows.transpose(1, 2)
        saved: list[tuple[torch.Tensor, torch.Tensor]] = []  # each layer's input and output
        linear = 0
        for i, layer in enumerate(self.layers):
            if layer.kind == "linear":
                w, _, b = views[linear]
                out = _product(w, h, b)
                linear += 1
            elif layer.kind == "flatten":
                out = h
            else:
                out = self._forwards[i](h)
            saved.append((h, out))
            h = out
        g = self.loss_grad(h, y, weight, losses)
        grads: dict[str, torch.Tensor] = {}
        for i in range(len(self.layers) - 1, self.first - 1, -1):
            layer, (inp, out) = self.layers[i], saved[i]
            if layer.kind == "linear":
                linear -= 1
                name = layer.name + ".weight"
                inp_rows = rows if inp is start else inp.transpose(1, 2)
                if into is None:
                    out = self.workspace.take(("grad", name), (K, g.shape[1], inp.shape[1]), g.dtype, g.device)
                    grads[name] = _product(g, inp_rows, out=out)
                elif into[1] is None:
                    grads[name] = _product(g, inp_rows, out=into[0][name])
                else:
                    grads[name] = _product(g, inp_rows, into[0][name], beta=into[1], out=into[0][name])
                if layer.bias:  # each client's sum over its batch: a reduction of each row alone, whose result does not
                    # depend on the group's other clients (a matrix-vector product over all clients' rows at once does)
                    bias = layer.name + ".bias"
                    if into is None:
                        grads[bias] = g.sum(2)
                    elif into[1] is None:
                        grads[bias] = torch.sum(g, 2, out=into[0][bias])
                    else:
                        grads[bias] = torch.add(g.sum(2), into[0][bias], alpha=into[1], out=into[0][bias])
                if i > self.first:
                    g = _product(views[linear][1], g)
            elif layer.kind == "activation":
                g = layer.activation[1](g, inp, out)  # type: ignore[index]  # inp is out where overwritten
        return {name: grads[name] for name in self.params}
