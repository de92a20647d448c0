"""An engine profile: what ``nano-engine profile`` measured, as nano-sim reads it.

One JSON file holds the engine's resolved configuration (KV blocks, budgets, CUDA-graph batch
sizes, async scheduling), the device time of steps over a grid of batch shapes, the host time
of the step loop's phases on real workloads (offline and through the HTTP server), and the
server's per-request latencies. Every value is checked on load and the file carries a checksum
of its content: a truncated, hand-edited or foreign file is an error that names the problem,
never a simulation on garbage.

A step record (``StepRecord``) is also the format of the engine's step log
(``nano-engine serve --step-log``): one loop iteration, its batch and where its time went.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

FORMAT = "nano-engine-profile"
STEP_LOG_FORMAT = "nano-engine-step-log"
VERSION = 1
HOST_PHASES = ("schedule", "launch", "post", "sample", "publish")  # a step record's, in order
SAMPLING_KINDS = ("greedy", "random", "top_p", "logprobs", "penalties")
FRONTENDS = ("offline", "server")
# The model dimensions a profile is tied to (Hugging Face config.json names).
MODEL_FIELDS = (
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
)


@dataclass(frozen=True)
class EngineSettings:
    """The engine configuration that decides scheduling and timing, as the engine resolved it."""

    block_size: int
    num_kv_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_prefix_caching: bool
    enable_chunked_prefill: bool
    policy: str
    admission_lookahead: int
    watermark: float
    async_scheduling: bool
    cuda_graph_sizes: tuple[int, ...]  # empty: eager decode
    # steps with attention outside a graph run as piecewise CUDA graphs (padded to
    # piecewise_graph_sizes(max_num_batched_tokens)); False in profiles from before them
    piecewise_graphs: bool = False
    tensor_parallel_size: int = 1
    dtype: str = "bfloat16"
    attention_backend: str = ""
    kv_cache_dtype: str = "auto"  # ("fp8": e4m3 K and V)
    quantization: str = ""  # the weights' ("fp8", a checkpoint's "fp8"; "": none)
    quantize_lm_head: bool = False  # the LM head's weight in e4m3 too


@dataclass
class StepRecord:
    """One iteration of the engine's step loop: the step it scheduled and launched, and the
    previous step it resolved (async scheduling; without it, the same step). Times in seconds.

    Host phases, in loop order: ``schedule`` (scheduler and step inputs), ``launch`` (the
    forward's launch; on a synchronous device, such as the CPU, without the compute),
    ``wait`` (for the resolved step's tokens), ``post`` (resolving them: scheduler, stop
    checks, detokenization, output objects), ``sample`` (the sampler's inputs and launch, the
    scheduler's advance), ``publish`` (outputs to their streams, statistics). Device:
    ``forward`` (the model, LM head included) and ``sample_device`` of this step's batch,
    measured when it resolves (None until then, or where not measured). ``cpu``: the loop
    thread's CPU seconds in each host phase (the wall time less waits for the GIL);
    ``server_cpu``: the CPU seconds of the server's event loop thread during the iteration
    (with the engine in a process of its own: of the whole front process, its event loop,
    the threads that carry requests and outputs, and the tokenizing workers),
    ``server_cpu_at``: since the log began, when the iteration began. ``gc``: seconds of
    Python's cyclic garbage collector during the iteration, in any thread (a collection
    holds the GIL: every thread waits for it).
    """

    t: float  # start of the iteration (time.monotonic)
    prefills: list[list[int]] = field(default_factory=list)  # [new tokens, cached before] each
    decodes: list[int] = field(default_factory=lambda: [0, 0, 0])  # count, context sum, max
    sampled: int = 0
    running: int = 0
    waiting: int = 0
    eager: bool = False  # the forward ran eagerly (not in a CUDA graph)
    resolved: int = 0  # tokens of the previous step read this iteration
    finished: int = 0  # sequences that finished this iteration
    outputs: int = 0  # request outputs published
    accepted: int = 0  # requests taken in before the iteration
    accepted_tokens: int = 0  # their prompt tokens
    schedule: float = 0.0
    launch: float = 0.0
    wait: float = 0.0
    post: float = 0.0
    sample: float = 0.0
    publish: float = 0.0
    forward: float | None = None
    sample_device: float | None = None
    cpu: list[float] | None = None  # the loop thread's CPU seconds of the five host phases
    server_cpu: float | None = None  # the server's event loop's (or front process's), meanwhile
    server_cpu_at: float | None = None  # its CPU seconds since the log began, at ``t``
    gc: float | None = None  # the garbage collector's seconds in the iteration

    @property
    def host(self) -> float:
        return self.schedule + self.launch + self.post + self.sample + self.publish

    @property
    def num_tokens(self) -> int:
        return sum(n for n, _ in self.prefills) + self.decodes[0]

    def to_dict(self) -> dict:
        """Its fields (the lists shared, not copied: the loop's step log writes hundreds a
        second, and ``asdict``'s deep copy tripled the cost)."""
        return dict(vars(self))

    @classmethod
    def from_dict(cls, data: Any, where: str) -> StepRecord:
        if not isinstance(data, dict):
            raise ValueError(f"{where} must be an object, got {_kind(data)}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{where} has unknown fields {unknown}")
        rec = cls(t=_number(data, "t", where))
        rec.prefills = [
            [_count(p, 0, f"{where}.prefills[{i}]"), _count(p, 1, f"{where}.prefills[{i}]")]
            for i, p in enumerate(_list(data, "prefills", where, []))
        ]
        for i, p in enumerate(rec.prefills):
            if p[0] < 1:
                raise ValueError(f"{where}.prefills[{i}] computes no tokens")
        dec = _list(data, "decodes", where, [0, 0, 0])
        if len(dec) != 3:
            raise ValueError(f"{where}.decodes must be [count, context sum, context max]")
        rec.decodes = [_count(dec, i, f"{where}.decodes") for i in range(3)]
        for name in (
            "sampled",
            "running",
            "waiting",
            "resolved",
            "finished",
            "outputs",
            "accepted",
            "accepted_tokens",
        ):
            setattr(rec, name, _count(data, name, where, 0))
        rec.eager = _bool(data, "eager", where, False)
        for name in (*HOST_PHASES, "wait"):
            setattr(rec, name, _number(data, name, where, 0.0, low=0.0))
        for name in ("forward", "sample_device", "server_cpu", "server_cpu_at", "gc"):
            if data.get(name) is not None:
                setattr(rec, name, _number(data, name, where, low=0.0))
        if data.get("cpu") is not None:
            cpu = _list(data, "cpu", where)
            if len(cpu) != 5:
                raise ValueError(f"{where}.cpu must hold the five host phases' CPU seconds")
            rec.cpu = [_number(cpu, i, f"{where}.cpu", low=0.0) for i in range(5)]
        return rec


@dataclass
class RequestTiming:
    """One request as the engine saw it (monotonic seconds): ``arrival`` when it was accepted,
    ``first_token`` and ``finish`` when those outputs were published, by the iterations
    ``first_step`` and ``last_step`` of the step log; ``received``: when the server's front,
    in a process of its own, had it validated (the same clock on one host; None: the engine
    runs in the front's process)."""

    id: str
    arrival: float
    prompt_tokens: int
    output_tokens: int = 0
    first_scheduled: float | None = None
    first_token: float | None = None
    finish: float | None = None
    first_step: int | None = None
    last_step: int | None = None
    received: float | None = None

    @classmethod
    def from_dict(cls, data: Any, where: str) -> RequestTiming:
        if not isinstance(data, dict):
            raise ValueError(f"{where} must be an object, got {_kind(data)}")
        req = cls(
            str(_get(data, "id", where, _MISSING)),
            _number(data, "arrival", where),
            _count(data, "prompt_tokens", where),
        )
        req.output_tokens = _count(data, "output_tokens", where, 0)
        for name in ("first_scheduled", "first_token", "finish", "received"):
            if data.get(name) is not None:
                setattr(req, name, _number(data, name, where))
        for name in ("first_step", "last_step"):
            if data.get(name) is not None:
                setattr(req, name, _count(data, name, where))
        return req


@dataclass
class StepLog:
    """The engine's step log: every iteration of its loop, and every request it served."""

    steps: list[StepRecord]
    requests: list[RequestTiming]
    device: dict[str, Any] = field(default_factory=dict)


def read_step_log(path: str | Path) -> StepLog:
    """A step log written by the engine (JSON lines: a header, then steps and requests);
    ``ValueError`` naming the file, the line and the problem."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read the step log {path}: {e.strerror or e}") from None
    log = StepLog([], [])
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not JSON ({e.msg}): truncated?") from None
        if number == 1:
            if not isinstance(item, dict) or item.get("format") != STEP_LOG_FORMAT:
                raise ValueError(f"{path}: not a {STEP_LOG_FORMAT} file")
            if item.get("version") != VERSION:
                raise ValueError(
                    f"{path}: step log version {item.get('version')!r} is not {VERSION}"
                )
            log.device = item.get("device") if isinstance(item.get("device"), dict) else {}
            continue
        where = f"{path}:{number}"
        if isinstance(item, dict) and "step" in item:
            log.steps.append(StepRecord.from_dict(item["step"], f"{where}: step"))
        elif isinstance(item, dict) and "request" in item:
            log.requests.append(RequestTiming.from_dict(item["request"], f"{where}: request"))
        else:
            raise ValueError(f"{where}: expected a step or a request")
    if not lines:
        raise ValueError(f"{path} is empty")
    return log


@dataclass(frozen=True)
class GridPoint:
    """A step's device time measured on its own: prefill chunks and decodes."""

    prefills: tuple[tuple[int, int], ...]  # (new tokens, cached before)
    num_decodes: int
    decode_context: int  # each decode's context (all equal in the grid)
    seconds: float

    @property
    def num_tokens(self) -> int:
        return sum(n for n, _ in self.prefills) + self.num_decodes


@dataclass
class Profile:
    model: dict[str, int]
    device: dict[str, Any]  # type (cuda, cpu), name, synchronous
    engine: EngineSettings
    decode_graphs: list[GridPoint]  # CUDA-graph decode steps: batch = a graph size
    eager: list[GridPoint]  # eager forwards: prefills, mixed steps, decodes
    sampling: dict[str, list[tuple[int, float]]]  # kind -> (rows, seconds)
    host: dict[str, list[StepRecord]]  # frontend -> loop iterations
    # ingress: [[prompt tokens, seconds], ...] (sent -> accepted); egress: [[outputs published
    # with it, seconds], ...] (first token published -> received); workloads: [[first step,
    # end step (of host["server"]), requests, prompt tokens, the event loop thread's CPU
    # seconds, the seconds its requests were sent over (0: at once; older profiles lack it)],
    # ...]; first_request_s: the first request's extra time; engine_process: whether the
    # engine ran in a process of its own (the default; then the "event loop" CPU is the whole
    # front process's, and no lock is shared with the loop thread; older profiles lack it:
    # False). (The event loop's CPU time during each iteration is in the server's step
    # records.)
    server: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)  # model name, date, version, command

    # ---- files -------------------------------------------------------------------------------

    def to_json(self) -> dict:
        data = {
            "format": FORMAT,
            "version": VERSION,
            "meta": self.meta,
            "model": self.model,
            "device": self.device,
            "engine": {
                **asdict(self.engine),
                "cuda_graph_sizes": list(self.engine.cuda_graph_sizes),
            },
            "decode_graphs": [_point_json(p) for p in self.decode_graphs],
            "eager": [_point_json(p) for p in self.eager],
            "sampling": {k: [list(p) for p in v] for k, v in self.sampling.items()},
            "host": {k: [r.to_dict() for r in v] for k, v in self.host.items()},
            "server": self.server,
        }
        data["checksum"] = _checksum(data)
        return data

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), separators=(",", ":")))

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """Read and check a profile; ``ValueError`` naming the file and the problem."""
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as e:
            raise ValueError(f"cannot read the profile {path}: {e.strerror or e}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(
                f"{path} is not a complete JSON profile ({e.msg} at line {e.lineno}, column "
                f"{e.colno}): truncated or not written by nano-engine profile"
            ) from None
        try:
            return cls.from_json(data)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    @classmethod
    def from_json(cls, data: Any) -> Profile:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} file (written by nano-engine profile)")
        if data.get("version") != VERSION:
            raise ValueError(
                f"profile version {data.get('version')!r} is not {VERSION}: profile the engine "
                "again with this version"
            )
        if data.get("checksum") != _checksum(data):
            raise ValueError(
                "its checksum does not match its content: the file was edited or damaged "
                "after nano-engine profile wrote it; profile again (and override settings "
                "with nano-sim's options, not in the file)"
            )
        model = _dict(data, "model", "profile")
        model = {name: _count(model, name, "model", low=1) for name in MODEL_FIELDS}
        device = _dict(data, "device", "profile")
        _bool(device, "synchronous", "device")
        engine = _engine(_dict(data, "engine", "profile"))
        graphs = [
            _point(p, f"decode_graphs[{i}]") for i, p in enumerate(_list(data, "decode_graphs", ""))
        ]
        for i, p in enumerate(graphs):
            if p.prefills or p.num_decodes not in engine.cuda_graph_sizes:
                raise ValueError(
                    f"decode_graphs[{i}] is not a decode batch of a captured size "
                    f"{list(engine.cuda_graph_sizes)}"
                )
        if engine.cuda_graph_sizes and not graphs:
            raise ValueError("the engine captures CUDA graphs but decode_graphs is empty")
        eager = [_point(p, f"eager[{i}]") for i, p in enumerate(_list(data, "eager", ""))]
        if not eager:
            raise ValueError("eager is empty: no prefill step was measured")
        sampling = {}
        for kind, points in _dict(data, "sampling", "profile").items():
            if kind not in SAMPLING_KINDS:
                raise ValueError(f"sampling has an unknown kind {kind!r}; known {SAMPLING_KINDS}")
            if not isinstance(points, list) or not points:
                raise ValueError(f"sampling.{kind} must be a non-empty list of [rows, seconds]")
            sampling[kind] = [
                (
                    _count(p, 0, f"sampling.{kind}[{i}]", low=1),
                    _number(p, 1, f"sampling.{kind}[{i}]", low=0.0),
                )
                for i, p in enumerate(points)
            ]
        if "greedy" not in sampling:
            raise ValueError("sampling.greedy is missing")
        host = {}
        for frontend, records in _dict(data, "host", "profile").items():
            if frontend not in FRONTENDS:
                raise ValueError(f"host has an unknown frontend {frontend!r}; known {FRONTENDS}")
            if not isinstance(records, list) or not records:
                raise ValueError(f"host.{frontend} must be a non-empty list of step records")
            host[frontend] = [
                StepRecord.from_dict(r, f"host.{frontend}[{i}]") for i, r in enumerate(records)
            ]
        if not host:
            raise ValueError("host is empty: no step of the loop was measured")
        server = _dict(data, "server", "profile")
        # (a workload's sixth number, the seconds its requests were sent over, is newer)
        for name, widths in (("ingress", (2,)), ("egress", (2,)), ("workloads", (5, 6))):
            for i, p in enumerate(_list(server, name, "server", [])):
                if not isinstance(p, list) or len(p) not in widths:
                    count = " or ".join(map(str, widths))
                    raise ValueError(f"server.{name}[{i}] must be a list of {count} numbers")
                for j in range(len(p)):
                    _number(p, j, f"server.{name}[{i}]", low=0.0)
        if server.get("first_request_s") is not None:
            _number(server, "first_request_s", "server", low=0.0)
        if not isinstance(server.get("engine_process", False), bool):
            raise ValueError("server.engine_process must be true or false")
        meta = data.get("meta") if isinstance(data.get("meta"), dict) else {}
        return cls(model, device, engine, graphs, eager, sampling, host, server, meta)

    # ---- checks ------------------------------------------------------------------------------

    def check_model(self, hf_config: dict) -> None:
        """``ValueError`` unless a Hugging Face config has this profile's dimensions."""
        heads = hf_config.get("num_attention_heads")
        given = {
            "num_hidden_layers": hf_config.get("num_hidden_layers"),
            "hidden_size": hf_config.get("hidden_size"),
            "num_attention_heads": heads,
            "num_key_value_heads": hf_config.get("num_key_value_heads") or heads,
            "head_dim": hf_config.get("head_dim")
            or (hf_config.get("hidden_size") or 0) // (heads or 1),
            "intermediate_size": hf_config.get("intermediate_size"),
            "vocab_size": hf_config.get("vocab_size"),
        }
        wrong = [f"{k} {given[k]} (profiled: {v})" for k, v in self.model.items() if given[k] != v]
        if wrong:
            raise ValueError(
                "the profile was measured on another model: " + ", ".join(wrong) + "; profile "
                "this model with nano-engine profile"
            )


def _checksum(data: dict) -> str:
    content = {k: v for k, v in data.items() if k != "checksum"}
    text = json.dumps(content, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def _point_json(p: GridPoint) -> dict:
    return {
        "prefills": [list(c) for c in p.prefills],
        "decodes": [p.num_decodes, p.decode_context],
        "seconds": p.seconds,
    }


def _point(data: Any, where: str) -> GridPoint:
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be an object, got {_kind(data)}")
    prefills = tuple(
        (_count(c, 0, f"{where}.prefills[{i}]", low=1), _count(c, 1, f"{where}.prefills[{i}]"))
        for i, c in enumerate(_list(data, "prefills", where, []))
    )
    decodes = _list(data, "decodes", where)
    if len(decodes) != 2:
        raise ValueError(f"{where}.decodes must be [count, context of each]")
    count, context = _count(decodes, 0, f"{where}.decodes"), _count(decodes, 1, f"{where}.decodes")
    if not prefills and not count:
        raise ValueError(f"{where} is an empty step")
    if count and context < 1:
        raise ValueError(f"{where}.decodes: a decode's context is >= 1 token")
    return GridPoint(
        prefills, count, context, _number(data, "seconds", where, low=0.0, open_low=True)
    )


def _engine(data: dict) -> EngineSettings:
    known = {f.name for f in fields(EngineSettings)}
    optional = {
        "tensor_parallel_size",
        "dtype",
        "attention_backend",
        "piecewise_graphs",
        "kv_cache_dtype",
        "quantization",
        "quantize_lm_head",
    }
    missing = sorted(known - set(data) - optional)
    if missing:
        raise ValueError(f"engine lacks {missing}")
    ints = (
        "block_size",
        "num_kv_blocks",
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_model_len",
    )
    values: dict[str, Any] = {name: _count(data, name, "engine", low=1) for name in ints}
    for name in ("enable_prefix_caching", "enable_chunked_prefill", "async_scheduling"):
        values[name] = _bool(data, name, "engine")
    values["piecewise_graphs"] = _bool(data, "piecewise_graphs", "engine", False)
    values["policy"] = _str(data, "policy", "engine")
    values["admission_lookahead"] = _count(data, "admission_lookahead", "engine")
    values["watermark"] = _number(data, "watermark", "engine", low=0.0)
    sizes = _list(data, "cuda_graph_sizes", "engine")
    values["cuda_graph_sizes"] = tuple(
        _count(sizes, i, "engine.cuda_graph_sizes", low=1) for i in range(len(sizes))
    )
    if list(values["cuda_graph_sizes"]) != sorted(set(values["cuda_graph_sizes"])):
        raise ValueError("engine.cuda_graph_sizes must be ascending and distinct")
    values["tensor_parallel_size"] = _count(data, "tensor_parallel_size", "engine", 1, low=1)
    values["dtype"] = _str(data, "dtype", "engine", "bfloat16")
    values["attention_backend"] = _str(data, "attention_backend", "engine", "")
    values["kv_cache_dtype"] = _str(data, "kv_cache_dtype", "engine", "auto")
    values["quantization"] = _str(data, "quantization", "engine", "")
    values["quantize_lm_head"] = _bool(data, "quantize_lm_head", "engine", False)
    return EngineSettings(**values)


_MISSING = object()


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _get(data: Any, key: str | int, where: str, default: Any) -> Any:
    try:
        return data[key]
    except (KeyError, IndexError, TypeError):
        if default is _MISSING:
            at = f"{where}.{key}" if isinstance(key, str) else f"{where}[{key}]"
            raise ValueError(f"{at.lstrip('.')} is missing") from None
        return default


def _number(data, key, where, default=_MISSING, *, low=None, open_low=False) -> float:
    value = _get(data, key, where, default)
    at = (f"{where}.{key}" if isinstance(key, str) else f"{where}[{key}]").lstrip(".")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{at} must be a finite number, got {value!r}")
    if low is not None and (value < low or (open_low and value <= low)):
        raise ValueError(f"{at} must be {'>' if open_low else '>='} {low}, got {value!r}")
    return float(value)


def _count(data, key, where, default=_MISSING, *, low=0) -> int:
    value = _get(data, key, where, default)
    at = (f"{where}.{key}" if isinstance(key, str) else f"{where}[{key}]").lstrip(".")
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{at} must be an integer >= {low}, got {value!r}")
    return value


def _bool(data, key, where, default=_MISSING) -> bool:
    value = _get(data, key, where, default)
    if not isinstance(value, bool):
        raise ValueError(f"{where}.{key} must be true or false, got {value!r}".lstrip("."))
    return value


def _str(data, key, where, default=_MISSING) -> str:
    value = _get(data, key, where, default)
    if not isinstance(value, str):
        raise ValueError(f"{where}.{key} must be a string, got {_kind(value)}".lstrip("."))
    return value


def _list(data, key, where, default=_MISSING) -> list:
    value = _get(data, key, where, default)
    if not isinstance(value, list):
        raise ValueError(f"{where}.{key} must be a list, got {_kind(value)}".lstrip("."))
    return value


def _dict(data, key, where) -> dict:
    value = _get(data, key, where, _MISSING)
    if not isinstance(value, dict):
        raise ValueError(f"{key} must be an object, got {_kind(value)}")
    return value
