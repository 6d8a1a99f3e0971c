"""The Engine interface: what the HTTP layer and the sync fence need from a generation backend.

Two engines implement it: ``hf`` (transformers ``generate``, CPU or GPU; the embedded default) and
``vllm`` (``AsyncLLM``). The app and the fence only ever talk to this interface, so every route,
the version counter and the sync state machine are tested with the hf engine on a CPU box.

Lifecycle and the calls the fence makes, in order, for one weight sync::

    start()                                   once, in the app lifespan (may take minutes)
    generate(...)  *                          many, concurrently; cancellable
    ── /sync/begin: admission closed; in-flight drained, or cancelled (fence mode abort) ──
    pause()                                   engine is quiet: no generate() task is running
    open_session(skip, adapter)               at /sync/init: which frozen names may stay unsent, the adapter's tensors
    stage_bucket(tensors) *                   validate against manifest(), keep a staged copy
    commit(expected_fingerprint) -> bool      atomic swap + cache reset; True = caches reset
      or discard()                            drop the staged copy, old weights stay
    resume()                                  before admission reopens
    stop()                                    once, at shutdown

What an engine does not know: HTTP, versions, sessions, authentication. Those live in
``rollout_server/routes/``, ``rollout_server/fence.py`` and ``rollout_server/weight_sync/session.py``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any

from dataclasses import dataclass, field

from common.data.images import InputError
from common.weight_sync.messages import AdapterSpec, TensorSpec
from common.wire.http import InferItem, InferOutput, SamplingParams


#: A request the engine cannot serve as given (missing image, prompt too long, ...): a 4xx naming
#: ``.field``. The generator shared with Stage-B raises it too, hence its home in common/.
EngineInputError = InputError


class WeightUpdateError(ValueError):
    """A staged bucket or commit that does not match the served model (name, shape, dtype,
    coverage, fingerprint): a 4xx, and the sync session is aborted with the old weights kept."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def check_token_budget(prompt_lens: Sequence[int], max_tokens: int, budget: int | None) -> None:
    """413 (:class:`EngineInputError`) when ``sum(prompt + max_tokens)`` over a batch exceeds ``budget``.

    ``budget`` is ``rollout_server.max_request_tokens`` (None = no budget). Clients split a 413'd batch.
    """
    if budget is None:
        return
    need = sum(prompt_lens) + max_tokens * len(prompt_lens)
    if need > budget:
        raise EngineInputError(
            f"{len(prompt_lens)} item(s) need {need} tokens (prompts {sum(prompt_lens)} + max_tokens {max_tokens} "
            f"each), over rollout_server.max_request_tokens = {budget}", "sampling.max_tokens", 413)


def check_prompt_lengths(items: Sequence[Any], max_tokens: int, max_model_len: int | None,
                         budget: int | None) -> None:
    """The length checks that need no tokenizer, run before a request takes an admission ticket or an
    engine thread: a token-id prompt that cannot fit the model's context with ``max_tokens`` (400 naming
    the item), and token-id prompts that alone are over ``budget`` (413, as :func:`check_token_budget`).
    So a 1 M-id prompt is refused in microseconds instead of after the engine encoded it while every
    other request waited. Chat prompts are measured once tokenized, by the engine."""
    lens = [len(it.prompt_token_ids) for it in items if it.prompt_token_ids is not None]
    if max_model_len is not None:
        for i, it in enumerate(items):
            n = len(it.prompt_token_ids) if it.prompt_token_ids is not None else 0
            if n + max_tokens > max_model_len:
                raise EngineInputError(
                    f"prompt of {n} tokens + max_tokens {max_tokens} exceeds the model's {max_model_len} positions "
                    f"(item {i})", f"items.{i}.prompt_token_ids")
    check_token_budget(lens, max_tokens, budget)


@dataclass
class SessionTerms:
    """What :meth:`Engine.open_session` agreed to (``SyncInitResponse.skip``, ``skip_refused``, ``adapter_manifest``)."""

    skip: list[str] = field(default_factory=list)
    skip_refused: str | None = None
    adapter_manifest: list[TensorSpec] = field(default_factory=list)


class EngineUnavailable(RuntimeError):
    """The selected engine cannot run here (e.g. vLLM not installed); the message names the fix."""


class Engine(abc.ABC):
    """A generation backend with a staged, atomically committed weight update."""

    #: ``hf`` or ``vllm`` (reported in /health and every InferResponse).
    name: str = "engine"
    #: ``rollout_server.max_request_tokens``: prompt + max_tokens over one generate call; None = none.
    max_request_tokens: int | None = None
    #: Positions one sequence (prompt + generation) may use, known once started; None = unknown.
    max_model_len: int | None = None
    #: Called with the tokens a cancelled generation had produced (the server counts them as generated);
    #: set by the app. An engine that cannot see a cancelled request's partial output (vLLM) does not call it.
    on_cancelled_tokens: Callable[[int], None] | None = None
    #: Whether the engine merges an adapter pushed by an ``adapter`` session (``SyncInitRequest.adapter``).
    merges_adapters: bool = False
    #: Why the engine sends every frozen name a learner declares (``SyncInitRequest.skip``) back as refused, so
    #: the learner pushes them in full; None: it takes them.
    skip_refused_reason: str | None = None

    def __init__(self, model_path: str) -> None:
        self.model_path = model_path
        #: How the last NCCL update was loaded (engine-specific timings), returned by ``/sync/update``.
        self.last_update_info: dict[str, float | str | bool | None] | None = None
        self._manifest: dict[str, TensorSpec] = {}  # served name -> spec, in the order the learner sends
        self._tied: list[list[str]] = []
        self._alias: dict[str, str] = {}  # tied non-first name -> manifest name
        # Served names some commit has written since start(): their copy may differ from the loaded checkpoint, so
        # a learner's claim that its frozen copy equals the server's is not taken for them (open_session).
        self._written: set[str] = set()
        self._skip: set[str] = set()  # the open session's accepted SyncInitRequest.skip

    def _set_manifest(self, spec: list[TensorSpec], tied: list[list[str]]) -> None:
        """What :meth:`start` learned of the served model (``common.weight_sync.weights.manifest_of``)."""
        self._manifest = {s.name: s for s in spec}
        self._tied = [list(g) for g in tied]
        self._alias = {n: g[0] for g in self._tied for n in g[1:]}

    def _spec_of(self, name: str) -> tuple[str, TensorSpec]:
        """The manifest name and spec a sent name stands for (tied names map to their group's first)."""
        canonical = self._alias.get(name, name)
        spec = self._manifest.get(canonical)
        if spec is None:
            raise WeightUpdateError(f"{name!r} is not a parameter of the served model (send HF module names, "
                                    f"e.g. {next(iter(self._manifest), '?')!r})", name)
        return canonical, spec

    def open_session(self, skip: list[str], adapter: AdapterSpec | None) -> SessionTerms:
        """``/sync/init``'s declarations, before any fence closes. ``skip``: each must be a served name (else
        :class:`WeightUpdateError`, a 400 naming it); it is accepted unless a commit has written it since the
        server loaded its weights (then the learner sends it, and :attr:`SessionTerms.skip_refused` says why).
        The commit then takes the accepted names from the served copy (coverage and fingerprint). ``adapter``:
        refused here; an engine that merges adapters (:attr:`merges_adapters`) overrides :meth:`_open_adapter`."""
        accepted, written = [], []
        for name in skip:
            canonical, _ = self._spec_of(name)
            (written if canonical in self._written else accepted).append(canonical)
        refused = None
        if skip and self.skip_refused_reason is not None:
            accepted, refused = [], self.skip_refused_reason
        elif written:
            refused = (f"{len(written)} declared frozen parameter(s) were written by an earlier sync since the "
                       f"server loaded its weights (first: {written[0]!r}), so its copy may not be the checkpoint's: "
                       "sent in full")
        manifest = self._open_adapter(adapter) if adapter is not None else []
        self._skip = set(accepted)
        return SessionTerms(skip=sorted(self._skip), skip_refused=refused, adapter_manifest=manifest)

    def _open_adapter(self, adapter: AdapterSpec) -> list[TensorSpec]:
        """The adapter tensors an ``adapter`` session sends (``rollout_server/engines/adapter_merge.py``)."""
        raise WeightUpdateError(f"the {self.name} engine does not merge adapters pushed alone: set "
                                "model.adapter.sync: merged (the learner pushes merged full weights), or serve "
                                "with rollout_server.engine: hf", "adapter")

    def _end_session(self, committed: set[str] | None = None) -> None:
        """Forget the session's declarations; ``committed``: the names a commit just wrote."""
        self._skip = set()
        if committed:
            self._written |= committed

    def collective_backend(self) -> str:
        """Backend of the weight-transfer group this engine joins for ``transport: nccl``."""
        return "nccl"

    async def receive_ipc(self, req: Any) -> int:
        """``/sync/ipc`` (an engine listing ``ipc`` in ``transports``): copy one bucket out of the learner's
        shared buffer (``req.source``, :func:`common.weight_sync.shared.open_shared`) before returning; bytes."""
        raise WeightUpdateError(f"the {self.name} engine does not take transport 'ipc'")

    # ---------------------------------------------------------------- lifecycle

    @abc.abstractmethod
    async def start(self) -> None:
        """Load the model; raise on failure (the server then exits with code 3)."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Release the model and any worker threads or processes; idempotent."""

    # ---------------------------------------------------------------- serving

    @abc.abstractmethod
    async def generate(self, items: Sequence[InferItem], sampling: SamplingParams) -> list[InferOutput]:
        """Complete every item under the current weights; outputs in item order.

        Cancelling the awaiting task stops the work (a sync fence in abort mode, a client that
        disconnected): the coroutine returns (raising ``CancelledError``) only once the engine no
        longer computes on behalf of this call, so the fence can rely on "no task running" meaning
        "engine quiet". Raises :class:`EngineInputError` for requests it cannot serve, a 413 for a
        batch over :attr:`max_request_tokens` (:func:`check_token_budget`, once prompts are tokenized).
        """

    @abc.abstractmethod
    def encode_text(self, prompt: str) -> list[int]:
        """Token ids of a raw text prompt (no chat template), for ``/v1/completions``."""

    # ---------------------------------------------------------------- weights

    def manifest(self) -> list[TensorSpec]:
        """Every served parameter the learner must send, once each (tied groups: first name only)."""
        return list(self._manifest.values())

    def tied_groups(self) -> list[list[str]]:
        """Groups of parameter names sharing one storage; the first of each is in the manifest."""
        return [list(g) for g in self._tied]

    @abc.abstractmethod
    def serving_dtype(self) -> str:
        """Torch dtype name floating-point weights are served in (``bfloat16``, ``float32``, ...)."""

    async def pause(self) -> None:
        """Called once the fence is closed and no generate() runs (vLLM: pause the scheduler)."""

    async def resume(self) -> None:
        """Called before admission reopens, after a commit or a discard."""

    @abc.abstractmethod
    async def stage_bucket(self, tensors: dict[str, Any]) -> int:
        """Validate ``{name: tensor}`` against the manifest and keep it staged; returns bytes staged.

        Raises :class:`WeightUpdateError` naming the tensor for an unknown name, a repeat, or a
        wrong shape or dtype. Served weights are untouched until :meth:`commit`.
        """

    @abc.abstractmethod
    async def commit(self, expected_fingerprint: str | None = None) -> bool:
        """Swap the staged weights in, all or nothing, then reset caches.

        Raises :class:`WeightUpdateError` (old weights kept) when the staged set does not cover the
        manifest or its fingerprint differs from ``expected_fingerprint``. Returns whether every
        cache reset succeeded (a False leaves the server unable to vouch for outputs: the caller
        marks it in error and does not bump ``ver``).
        """

    @abc.abstractmethod
    async def discard(self) -> None:
        """Drop whatever is staged; the served weights never changed."""

    @abc.abstractmethod
    def fingerprint(self) -> str:
        """Cheap deterministic hash of the served weights (see ``common.weight_sync.weights.fingerprint``)."""

    async def weights_digest(self) -> list[str]:
        """Exact digest of the served weights, one per worker holding weights (``GET /sync/digest``).

        Each entry is ``common.weight_sync.weights.exact_digest`` over that worker's served parameters
        (manifest names), computed where the weights live. Unlike :meth:`fingerprint` it reads every
        element, so equal entries mean bit-identical weights: ops and GPU tests compare workers, or
        two weight-load paths, with it. Called only while no sync session is open.
        """
        raise NotImplementedError(f"the {self.name} engine does not compute weight digests "
                                  "(Engine.weights_digest is not implemented for it)")

    # ---------------------------------------------------------------- reporting

    def world_size(self) -> int:
        """Workers that receive weights (tensor x data parallel)."""
        return 1

    def health_info(self) -> dict[str, Any]:
        """Extra facts for logs (device, dtype, parameter count); JSON-safe values only."""
        return {}
