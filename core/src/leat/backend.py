"""The Backend contract: device memory and the ops architectures are written against.

An architecture's ``forward`` calls only these methods, so one model file runs on every backend.
Activations are opaque backend arrays (numpy arrays on the CPU, device buffers elsewhere); only
:meth:`Backend.to_host` turns one into numpy. Shapes below use ``n`` for the tokens of a batch
(all rows' spans concatenated), ``d`` for the model width.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Self

import gguf
import numpy as np

from leat.batch import Batch
from leat.errors import BackendUnavailable, LeatError
from leat.modelfile import Tensor

if TYPE_CHECKING:
    from leat.deltanet import DeltaNet
    from leat.moe import MoESpec, MoEWeights


@dataclass(frozen=True)
class RopeSpec:
    """How one layer rotates q and k.

    ``neox``: rotate halves (x[i], x[i + dims/2]), as GPT-NeoX, Qwen and Gemma; otherwise adjacent
    pairs (x[2i], x[2i+1]), as llama.cpp's LLAMA_ROPE_TYPE_NORM for Llama (its GGUF q/k weights are
    permuted for that layout). ``freq_factors`` divide each pair's frequency (Llama 3 ``rope_freqs``).
    """

    dims: int
    base: float = 10000.0
    neox: bool = False
    scale: float = 1.0  # linear position scaling: positions are multiplied by this
    freq_factors: np.ndarray | None = None
    attn_factor: float = 1.0  # cos and sin are multiplied by this (YaRN's magnitude; see leat.rope)


@dataclass(frozen=True)
class KVLayout:
    """What one layer keeps per token in the KV cache."""

    kv_heads: int
    head_dim: int
    value_dim: int | None = None
    window: int | None = None  # sliding-window layers attend to the last `window` positions only
    # MLA (DeepSeek 2/3): each key is [latent, rope key] and the values are its first `value_dim`
    # entries (the latent), so only keys are stored; see Backend.mla_attention
    latent: bool = False

    @property
    def stored_value_dim(self) -> int:
        """Entries per token and head that the V storage holds (0 for a latent layout)."""
        return 0 if self.latent else (self.value_dim or self.head_dim)

    def bytes_per_token(self, element_bytes: int) -> int:
        return self.kv_heads * (self.head_dim + self.stored_value_dim) * element_bytes


@dataclass
class KVPages:
    """What every backend's KV storage shares: shape facts and the host copies of the page tables.

    Layers are split into page groups (``group_of``); each group has its own page count and page
    table, so a sliding-window group can hold only the pages its window still needs while a
    full-attention group holds whole sequences. Backends subclass it to add their storage (numpy
    arrays, device buffers): layer ``l`` holds ``pages[group_of[l]]`` pages.
    """

    layouts: list[KVLayout]
    slots: int
    page_size: int
    group_of: list[int]  # per layer: the index of its page group
    pages: list[int]  # per group: how many pages its layers' storage holds
    tables: list[np.ndarray]  # per group: [slots, pages_per_slot] int32, -1 = no page

    @classmethod
    def create(
        cls,
        layouts: list[KVLayout],
        slots: int,
        context: int,
        pages: int | Sequence[int] | None,
        page_size: int,
        groups: Sequence[int] | None = None,
        **storage: Any,
    ) -> Self:
        """The cache :meth:`Backend.allocate_kv` describes, tables filled, before any storage is added
        (``storage`` sets the subclass's own fields)."""
        group_of = list(groups) if groups is not None else [0] * len(layouts)
        count = max(group_of, default=0) + 1
        if sorted(set(group_of)) != list(range(count)) or len(group_of) != len(layouts):
            raise ValueError(f"groups must give each of the {len(layouts)} layers a group 0, 1, ...: {group_of}")
        per_slot = -(-context // page_size)
        if pages is None:
            numbered = np.arange(slots * per_slot, dtype=np.int32).reshape(slots, per_slot)
            sizes, tables = [slots * per_slot] * count, [numbered.copy() for _ in range(count)]
        else:
            sizes = [pages] * count if isinstance(pages, int) else [int(p) for p in pages]
            if len(sizes) != count:
                raise ValueError(f"{len(sizes)} page counts for {count} page groups")
            tables = [np.full((slots, per_slot), -1, dtype=np.int32) for _ in range(count)]
        return cls(list(layouts), slots, page_size, group_of, sizes, tables, **storage)

    @property
    def context(self) -> int:
        """The most positions one slot can hold."""
        return self.tables[0].shape[1] * self.page_size

    def table(self, layer: int) -> np.ndarray:
        """The page table [slots, pages_per_slot] that ``layer`` reads and writes through."""
        return self.tables[self.group_of[layer]]

    def layer_pages(self, layer: int) -> int:
        """How many pages ``layer``'s storage holds."""
        return self.pages[self.group_of[layer]]

    def layers_of(self, group: int) -> list[int]:
        return [layer for layer, g in enumerate(self.group_of) if g == group]

    @property
    def page_table(self) -> np.ndarray:
        """The page table of a cache whose layers are one group."""
        if len(self.tables) != 1:
            raise ValueError("this KV cache has a page table per layer group: use table(layer)")
        return self.tables[0]


def window_groups(layouts: list[KVLayout]) -> tuple[list[int], list[int | None]]:
    """Page groups by window: each layer's group, and each group's window (full attention first, as None).

    Layers of one window share a group, so a sliding-window group's pages can be released once every
    query still to come is past them.
    """
    windows = sorted({layout.window for layout in layouts}, key=lambda w: -1 if w is None else w)
    return [windows.index(layout.window) for layout in layouts], windows


@dataclass
class Allocations:
    """Physical bytes a backend holds, by purpose."""

    weights: int = 0
    kv: int = 0
    scratch: int = 0
    by_type: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class ReadyIds:
    """Token ids already on the host: what the default :meth:`Backend.argmax_async` returns."""

    ids: np.ndarray

    def result(self) -> np.ndarray:
        return self.ids


class Backend:
    """Base class of compute backends. Subclasses implement every method that raises here."""

    name: ClassVar[str] = "?"
    #: quantization types whose tensors this backend can use (as stored or after its own conversion)
    quant_types: ClassVar[frozenset[gguf.GGMLQuantizationType]] = frozenset()
    #: True when :meth:`run` returns once the step is queued on the device, before it finishes; the engine then
    #: does the last step's host work (sending its tokens) while the device runs the next
    asynchronous: ClassVar[bool] = False
    #: True when :meth:`run` takes ``fed``: a step's tokens taken on the device from the last step's
    #: :meth:`argmax_async`, so that the engine can queue step N+1 before step N's tokens reach the host
    feeds_tokens: ClassVar[bool] = False
    #: prompt tokens the engine takes into one step (over several prompts) unless told otherwise: enough to keep
    #: the device's arithmetic busy when many prompts arrive together
    prefill_tokens_per_step: ClassVar[int] = 512
    #: prompt tokens of the steps an engine runs once when it starts (:meth:`leat.engine.Engine.start`), for a backend
    #: whose first step of a size costs more than the next (a library loading its kernels for that size, memory
    #: pools growing), so that a burst's first requests do not wait for it
    warm_up_steps: ClassVar[tuple[int, ...]] = ()
    #: True when :meth:`attention` honours rows marked ``bidirectional`` (what images in a prompt and vision encoders
    #: need); the engine refuses images on a backend without it
    bidirectional: ClassVar[bool] = False
    #: True when the backend keeps a recurrent state per sequence (:meth:`gated_delta_net`); a family with recurrent
    #: layers refuses a backend without it when it loads
    recurrent_state: ClassVar[bool] = False
    #: True when that state also rewinds into a verified draft (:meth:`gated_delta_net`); the engine refuses to
    #: speculate for a recurrent model on a backend without it
    rewinds_drafts: ClassVar[bool] = False

    @classmethod
    def probe(cls) -> str | None:
        """None when the backend can run on this machine, else why not. Must be cheap."""
        return None

    def __init__(self, precision: str = "f32", **options: Any):
        self.precision = precision
        self.options = options
        self.allocations = Allocations()

    def _missing(self) -> LeatError:
        """The error for an op this backend does not implement, naming the op (the caller's name)."""
        op = sys._getframe(1).f_code.co_name
        return BackendUnavailable(f"the {self.name} backend has no {op} op yet: run this model with --backend cpu")

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "precision": self.precision}

    def kv_budget_bytes(self) -> int:
        """Bytes the KV cache may take when the engine sizes the context itself."""
        return 2 << 30

    def timer(self) -> Any:
        """A context manager whose ``seconds``, read after it exits, is the device time of the work queued inside
        it (``leat bench --profile``); None where the backend cannot tell device time from host time."""
        return None

    # -- memory -------------------------------------------------------------------------------------
    @classmethod
    def weight_bytes(cls, tensors: Sequence[Tensor]) -> int | None:
        """Bytes ``tensors`` take in memory once uploaded with the default options, which ``leat doctor`` states
        before loading anything; None where the backend does not say."""
        return None

    def upload(self, tensor: Tensor) -> Any:
        """Place one GGUF tensor on the device and return the handle ops take as ``weight``."""
        raise self._missing()

    def allocate_kv(
        self,
        layouts: list[KVLayout],
        slots: int,
        context: int,
        pages: int | Sequence[int] | None = None,
        page_size: int = 16,
        dtype: str = "f32",
        groups: Sequence[int] | None = None,
    ) -> KVPages:
        """Paged KV storage for ``slots`` sequences of up to ``context`` positions each.

        ``groups`` puts each layer in a page group (default: one group of every layer; the engine
        groups by window, see :func:`window_groups`). Each group ``g`` has its own page table
        ``kv.tables[g]`` of ``slots`` rows that maps each sequence's positions to pages: position p
        of slot s in layer l lives in page ``kv.table(l)[s, p // page_size]`` at offset
        ``p % page_size``, and that layer's storage holds ``pages[g]`` pages of ``page_size`` tokens
        (an int ``pages`` is every group's count). A table entry may be -1 (no page) for positions
        that no query will read again: a windowed layer's attention reads only positions inside its
        window, so the engine releases the pages behind it.

        With ``pages`` None every slot gets its own ``ceil(context / page_size)`` pages in order in
        every group, so a caller that needs no sharing can ignore paging. The engine passes page
        budgets instead and assigns pages with :meth:`set_pages`. ``dtype`` is the storage: "f32"
        (the compute precision), "f16", or "q8_0" (blocks of 32 along the head dimension, as GGUF's
        Q8_0). :meth:`KVPages.create` builds the tables.
        """
        raise self._missing()

    def set_pages(self, kv: KVPages, slot: int, pages: np.ndarray, group: int = 0) -> None:
        """Give ``slot`` the page ids ``pages`` in ``group``'s table (in position order, -1 for a position
        without a page; the rest of its row becomes -1)."""
        table = kv.tables[group]
        table[slot] = -1
        table[slot, : len(pages)] = pages

    def copy_page(self, kv: KVPages, source: int, target: int, group: int = 0) -> None:
        """Copy one page's K/V in every layer of ``group`` (copy-on-write of a shared prefix page)."""
        raise self._missing()

    def read_pages(self, kv: KVPages, pages: list[int], group: int = 0) -> list[np.ndarray]:
        """The contents of ``pages`` in every layer of ``group``, as host arrays (to hibernate a session)."""
        raise self._missing()

    def write_pages(self, kv: KVPages, pages: list[int], contents: list[np.ndarray], group: int = 0) -> None:
        """Put back what :meth:`read_pages` returned for ``group``, into (possibly other) page ids of it."""
        raise self._missing()

    def to_host(self, x: Any) -> np.ndarray:
        raise self._missing()

    def from_host(self, x: np.ndarray) -> Any:
        """An activation holding the host float array ``x`` (an image's pixels on their way to a vision encoder)."""
        raise self._missing()

    def argmax(self, x: Any) -> np.ndarray:
        """The index of each row's largest entry (the first of equals): x [n, m] -> host int64 [n].

        Greedy decoding asks for this rather than :meth:`to_host` of the logits, so that a device
        backend can send n token ids to the host instead of n x vocabulary floats.
        """
        return np.argmax(self.to_host(x), axis=-1)

    def argmax_async(self, x: Any) -> Any:
        """:meth:`argmax`, started: an object whose ``result()`` is that host array, waiting for it if the device
        has not finished. A backend that :attr:`feeds_tokens` also takes the object as :meth:`run`'s ``fed``, so
        that it must stay valid until the step that reads it is queued. The default has the result at once."""
        return ReadyIds(self.argmax(x))

    def top_k(self, x: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` largest entries of each row and their indices: x [n, m] -> host (values [n, k], ids [n, k]).

        Rows are sorted by value, largest first; of equal values the lower index comes first (the order of
        numpy's stable argsort of -x), -inf entries included. Values keep the dtype :meth:`to_host` gives
        (float32 for float32 activations); ids are int64. A k above m gives m columns. Sampled decoding asks
        for this rather than :meth:`to_host` when its candidates are enough (see ``Engine.step``): n x k
        values cross to the host instead of n x vocabulary.
        """
        x = self.to_host(x)
        rows = x.reshape(-1, x.shape[-1])
        k = min(int(k), rows.shape[-1])
        ids = np.empty((len(rows), k), np.int64)
        for i, row in enumerate(rows):
            kth = np.partition(row, -k)[-k]
            above = np.flatnonzero(row > kth)
            candidates = np.concatenate([above, np.flatnonzero(row == kth)[: k - len(above)]])
            ids[i] = candidates[np.lexsort((candidates, -row[candidates]))]
        return np.take_along_axis(rows, ids, -1), ids

    def run(self, forward: Callable[[Batch, Any], Any], batch: Batch, kv: Any, fed: Any = None) -> Any:
        """One step of ``forward`` (an architecture's ``forward``) on ``batch``: its logits.

        ``fed`` (only where :attr:`feeds_tokens`): ``(ids, index)``, an earlier :meth:`argmax_async` and, for
        each row of ``batch`` (one token each), the row of that argmax that is its token; the batch's own token
        values are then placeholders.

        Callers that step a model call this rather than ``forward`` itself, so that a backend can
        freeze a step and replay it: the CUDA backend captures a CUDA graph per (forward, KV cache,
        batch-size bucket) the first time a decode batch (one token per row, or rows that want every
        token's logits, as speculative verification does) of that size comes,
        with the batch's tokens, positions and slots bound to static device buffers, and replays it
        afterwards. So a forward must be a function of what it hands to ops (the batch's arrays,
        ``len(batch)``, the batch passed to ``attention``), never branching on their values on the
        host. Logits from a replay stay valid until the next step of the same bucket. The default
        calls ``forward``.
        """
        if fed is not None:
            raise BackendUnavailable(f"the {self.name} backend does not feed tokens on the device")
        return forward(batch, kv)

    # -- ops -----------------------------------------------------------------------------------------
    def embed(self, weight: Any, tokens: np.ndarray) -> Any:
        """Rows of an embedding table: [n] token ids -> [n, d]."""
        raise self._missing()

    def matmul(self, x: Any, weight: Any, bias: Any = None) -> Any:
        """x [n, k] times the transpose of weight [m, k] (GGUF row-major), plus bias [m]: -> [n, m]."""
        raise self._missing()

    def matmuls(self, x: Any, weights: Sequence[Any], biases: Sequence[Any] | None = None) -> list[Any]:
        """x [n, k] times each of ``weights`` (plus its bias in ``biases``, None: none), in order: products of one
        input (a layer's q, k and v; gate and up) that a backend may make as one product of the weights side by
        side. The default calls :meth:`matmul` for each."""
        return [self.matmul(x, w, b) for w, b in zip(weights, biases or [None] * len(weights), strict=True)]

    def rms_norm(self, x: Any, weight: Any, eps: float) -> Any:
        """x / sqrt(mean(x^2) + eps) * weight over the last axis (weight None: no scale)."""
        raise self._missing()

    def layer_norm(self, x: Any, weight: Any, bias: Any, eps: float) -> Any:
        """(x - mean(x)) / sqrt(var(x) + eps) * weight + bias over the last axis (the population variance;
        ``weight`` or ``bias`` None: left out), as ggml_norm then its scale and shift (vision encoders)."""
        raise self._missing()

    def rope(self, x: Any, positions: np.ndarray, spec: RopeSpec) -> Any:
        """Rotate x [n, heads, head_dim] by each token's position."""
        raise self._missing()

    def attention(
        self,
        q: Any,
        k: Any,
        v: Any,
        kv: Any,
        layer: int,
        batch: Batch,
        scale: float,
        softcap: float | None = None,
        sinks: Any = None,
    ) -> Any:
        """Write k and v into the KV cache at each row's positions, then attend causally: every model's self-attention
        (Gemma 2's soft-capped scores and gpt-oss's sinks included) goes through this one op.

        :param q: [n, heads, dim] queries; heads is a multiple of kv_heads (grouped-query attention).
        :param k: [n, kv_heads, dim] keys of the batch's tokens, written into ``kv`` before any query reads.
        :param v: [n, kv_heads, value_dim] values, written likewise.
        :param kv: the cache :meth:`allocate_kv` made; position p of a row's slot in ``layer`` lives in page
            ``kv.table(layer)[slot, p // page_size]``.
        :param layer: which layer's storage, page table and :class:`KVLayout` (its window) apply.
        :param batch: the rows: each row's queries attend to its own slot's cached positions up to and including
            each query's position, or, in a row marked ``bidirectional`` (only where :attr:`bidirectional`), up to
            and including the row's last position (its k and v are written first). A layer with a window sees only
            the last ``window`` of them, and its table entries behind the window may be -1: such positions are
            masked, never read from a page -1 (skip them, or clamp the id).
        :param scale: the factor of each dot product, ``s_ij = scale * (q_i . k_j)``; query i of head h weights
            the unmasked keys j by ``exp(s_ij) / sum_j' exp(s_ij')``.
        :param softcap: None, or a cap on each score before the mask and softmax (Gemma 2):
            ``s_ij = softcap * tanh(scale * (q_i . k_j) / softcap)``.
        :param sinks: None, or an uploaded [heads] tensor (:meth:`upload`; gpt-oss): a learned logit per query
            head joins each softmax's denominator, ``exp(s_ij) / (exp(sinks[h]) + sum_j' exp(s_ij'))``, taking
            probability mass and contributing no value. ``softcap`` and ``sinks`` may be given together.
        :returns: [n, heads * value_dim], each head's weighted sum of values.

        A backend that lacks ``softcap`` or ``sinks`` raises :class:`~leat.errors.BackendUnavailable` naming it when
        it is given, and leaves that capability out of its conformance test (:class:`leat.conformance.BackendConformance`).
        """
        raise self._missing()

    def silu_mul(self, gate: Any, up: Any) -> Any:
        """silu(gate) * up, elementwise."""
        raise self._missing()

    def sigmoid_mul(self, gate: Any, x: Any) -> Any:
        """sigmoid(gate) * x, elementwise (Qwen3.5's gated attention output); a gate [n, 1] scales each row of x
        [n, m] (its MoE's shared expert)."""
        raise self._missing()

    def add(self, a: Any, b: Any) -> Any:
        raise self._missing()

    def reshape(self, x: Any, shape: tuple[int, ...]) -> Any:
        raise self._missing()

    def take_rows(self, x: Any, index: np.ndarray) -> Any:
        """The rows ``index`` of x [n, ...] (the positions whose logits are wanted)."""
        raise self._missing()

    def scale(self, x: Any, factor: float) -> Any:
        """x * factor, elementwise (Gemma's sqrt(d) embedding scale)."""
        raise self._missing()

    def gelu_mul(self, gate: Any, up: Any = None) -> Any:
        """gelu(gate) * up, elementwise (GeGLU), gelu in ggml's tanh approximation:
        0.5 * g * (1 + tanh(sqrt(2/pi) * (g + 0.044715 * g^3))); ``up`` None: gelu(gate) alone (a vision
        encoder's MLP; a backend without it raises :class:`~leat.errors.BackendUnavailable`).

        (ggml's CPU kernel looks gelu up in a table indexed by g rounded to f16, for |g| < 10; the
        formula is the reference, the table is one of ggml's roundings.)
        """
        raise self._missing()

    def softcap(self, x: Any, cap: float) -> Any:
        """cap * tanh(x / cap), elementwise (Gemma 2's final logit soft-capping)."""
        raise self._missing()

    def moe(self, x: Any, weights: MoEWeights, spec: MoESpec) -> Any:
        """A mixture-of-experts feed-forward over x [n, d] -> [n, d], routing included (see leat.moe).

        Per token: router logits ``x @ router.T + router_bias`` [experts]; the top ``spec.experts_used``
        experts and their weights as ``spec.gating``, ``spec.normalize`` and ``spec.scale`` say
        (:func:`leat.moe.route` is the reference); for each selected expert e,
        ``h = act(x @ gate[e].T + gate_bias[e], x @ up[e].T + up_bias[e])`` with ``spec.activation``
        (:func:`leat.moe.activate`), ``y_e = h @ down[e].T + down_bias[e]``; the output is the sum of
        the weighted ``y_e``. ``gate``/``up`` are [experts, ffn, d] and ``down`` [experts, d, ffn], as
        stored (any quant type the backend supports); absent biases are zero. ``weights.selection_bias``
        [experts] (DeepSeek V3's ``exp_probs_b``) and ``spec.groups`` (group-limited routing) change only
        which experts are selected, never their weights.
        """
        raise self._missing()

    def head_matmul(self, x: Any, weight: Any) -> Any:
        """Per head h, x[:, h] [n, k] times the transpose of weight[h] [m, k]: x [n, heads, k] -> [n, heads, m].

        ``weight`` is an uploaded 3-D tensor [heads, m, k] (GGUF's ``attn_k_b`` / ``attn_v_b``, any quant
        type the backend supports): MLA's absorption of the key up-projection into the queries and its
        per-head value up-projection.
        """
        raise self._missing()

    def mla_attention(
        self, q_latent: Any, q_rope: Any, latent: Any, k_rope: Any, kv: Any, layer: int, batch: Batch, scale: float
    ) -> Any:
        """Multi-head latent attention over a latent KV cache (DeepSeek 2/3, absorbed form), as MQA.

        ``latent`` [n, rank] and ``k_rope`` [n, rope] are written at each row's positions as one key
        ``[latent, k_rope]`` into ``kv``'s layer, whose layout is ``KVLayout(1, rank + rope, rank,
        latent=True)``. Query i of head h, ``[q_latent[i, h], q_rope[i, h]]`` ([n, heads, rank] and
        [n, heads, rope]), scores each cached key j with ``scale * (q_latent . latent_j + q_rope . k_rope_j)``;
        causal and window masks and the softmax are as :meth:`attention`, and the values are the cached
        latents: returns [n, heads, rank] (still latent; :meth:`head_matmul` with ``attn_v_b`` decompresses).
        """
        raise self._missing()

    def gated_delta_net(
        self, mixed: Any, alpha: Any, beta: Any, net: DeltaNet, kv: Any, layer: int, batch: Batch
    ) -> Any:
        """A gated delta-net layer (:mod:`leat.deltanet`, whose ``run`` is the reference) over each row of ``batch``:
        ``mixed`` [n, channels] (the qkv projection), ``alpha`` and ``beta`` [n, v_heads] -> [n, v_heads, head_dim].

        The recurrent state: per (``layer``, slot), the convolution's last ``kernel - 1`` inputs and the state
        matrices (:attr:`DeltaNet.state_shapes`), kept by the backend with ``kv`` (made on a layer's first call, one
        per slot of ``kv``; ``layer`` numbers these states apart from the KV layers). A row starting at position 0 is
        a new sequence and starts from zeros; a row starting at p continues the state its slot holds after p
        positions, or (where :attr:`rewinds_drafts`) rewinds to it where p lies inside the slot's last row and that
        row wanted every position's logits (``Row.all_logits``: a verified draft). A row starting anywhere else
        raises :class:`~leat.errors.LeatError`, so a model with such layers (:attr:`leat.architecture.Architecture.
        recurrent`) reuses no cached prefix and keeps no sessions; its KV pages are handled as any model's.
        """
        raise self._missing()
