"""JSONL batch jobs across machines on Ray Data: batch/job.py's job, with its lines run by a pool of LLM actors.

    ray.data.from_items(lines).map_batches(LLMActor, concurrency=A, batch_size=B, num_gpus=G)

The driver does what the local job does: it reads the input and, on resume, the output's done keys,
ships the lines not done, and writes each record as its batch comes back through `BatchJob.write`, the
one writer. So the output is the local job's: one record per line, the same keys, the same resume
contract. Each actor holds one `LLM` and runs its batch through `job.LineRunner`, so a bad line becomes
its own error record and the rest of its batch runs. A request without its own seed derives one from its
line's key, so which actor runs it does not change its tokens.

When an actor dies, Ray restarts it and runs its unfinished batch again, at most `RayOptions.max_retries` times
(`max_restarts=-1, max_task_retries=max_retries`, pinned in `map_batches`' remote args); a record
whose key was already written is dropped by the writer, so a retried batch never writes a line twice. A
batch that still fails is skipped (`max_errored_blocks=-1`), and its lines are run again one a batch, so
a line that kills its actor (a segfault, out of memory) ends as its own error record (500) after
1 + max_retries tries alone, and the other lines' records are written. When the driver dies,
`--resume` continues.

Ray is an optional extra: `pip install 'jaxinfer[ray]'`.
"""

import dataclasses
import json
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from jaxinfer.batch import step_log
from jaxinfer.scheduling.request import SamplingParams

from jaxinfer.validation import check_int, check_number

if TYPE_CHECKING:  # batch/job.py (and through it jax) is imported where it is used: the CLI's --help stays fast
    from jaxinfer.batch.input import InputLine
    from jaxinfer.batch.job import BatchJob
    from jaxinfer.batch.records import JobSummary
    from jaxinfer.config import EngineConfig
    from jaxinfer.options import LoadOptions

DEFAULT_BATCH_SIZE = 16  # lines per actor call: enough for continuous batching inside each actor
MAX_TASK_RETRIES = 2  # the default: a batch whose actor dies is run again this many times (on the restarted actor)


def _import_ray():
    try:
        import ray
    except ImportError:
        raise ImportError("--ray needs Ray Data: pip install 'jaxinfer[ray]'") from None
    return ray


@dataclasses.dataclass(frozen=True)
class RayOptions:
    """Where and how wide a job runs on Ray."""

    address: str | None = None  # None: start a local cluster (or join the one RAY_ADDRESS names); "auto": the running one
    num_actors: int = 1  # LLM actors, each holding one model replica
    batch_size: int = DEFAULT_BATCH_SIZE
    num_gpus: float = 0.0  # per actor (1 on GPU machines: one replica per GPU)
    num_cpus: float = 1.0  # per actor
    max_retries: int = MAX_TASK_RETRIES  # runs again of a batch, then of a line alone, whose actor died (each death restarts it)

    def __post_init__(self):
        check_int("num_actors", self.num_actors, low=1)
        check_int("max_retries", self.max_retries, low=0, high=100)
        check_int("batch_size", self.batch_size, low=1)
        check_number("num_gpus", self.num_gpus, low=0.0, high=1024.0)
        check_number("num_cpus", self.num_cpus, low=0.0, high=1024.0)


class LLMActor:
    """A Ray Data callable class: one LLM per actor; each call runs a batch of input lines.

    A batch holds the column "line" (each an InputLine as JSON); the result holds "key" and "record"
    (the line's record as JSON), one row per line, ok or error.
    """

    def __init__(self, model=None, load_options: "LoadOptions | None" = None, engine_config: "EngineConfig | None" = None, defaults: SamplingParams | None = None, truncate: str = "none"):
        from jaxinfer.api import LLM
        from jaxinfer.batch.job import LineRunner

        self.llm = LLM(model, options=load_options, engine_config=engine_config, progress=False)  # its stderr is a Ray log
        self.runner = LineRunner(defaults or SamplingParams(), truncate)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list[str]]:
        lines = [line_from_json(text) for text in batch["line"]]
        records = {record["key"]: record for record in self.runner.records(self.llm, lines)}
        return {"key": [line.key for line in lines], "record": [json.dumps(records[line.key]) for line in lines]}


def line_to_json(line: "InputLine") -> str:
    """The line for an actor: its fields as they are (dataclasses.asdict would copy its request's JSON, recursing in
    Python: a nesting the JSON decoder took could pass its limit). ASCII: a lone surrogate stays a JSON escape."""
    return json.dumps({field.name: getattr(line, field.name) for field in dataclasses.fields(line)})


def line_from_json(text: str) -> "InputLine":
    from jaxinfer.batch.input import InputLine

    return InputLine(**json.loads(text))


def run_job(
    job: "BatchJob", options: RayOptions, *, model=None, load_options: "LoadOptions | None" = None, engine_config: "EngineConfig | None" = None, progress: bool = True,
    actor: type = LLMActor,
) -> "JobSummary":
    """Run a BatchJob's remaining lines on a Ray cluster; the records land in the job's output. `actor`:
    the Ray Data callable class that runs a batch (LLMActor, or a subclass of it)."""
    ray = _import_ray()
    if not ray.is_initialized():
        ray.init(address=options.address, log_to_driver=False)
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = progress
    context.max_errored_blocks = -1  # a batch whose actor died too often is skipped; its lines are tried again alone
    actor_kwargs = {"model": None if model is None else str(model), "load_options": load_options, "engine_config": engine_config}
    # its steps run in the actors: no step log describes this run, and one an earlier run left would pass for it (whatif)
    step_log.log_path(job.output).unlink(missing_ok=True)
    return job.write(_records(ray, job, options, actor, actor_kwargs))


def _records(ray, job: "BatchJob", options: RayOptions, actor: type, actor_kwargs: dict) -> Iterator[dict]:
    """Every line's record: the lines run in batches; the lines of a batch that kept killing its actor
    run again one a batch; a line that still kills its actor gets its error record."""
    from jaxinfer.batch.records import error_record

    pending, num_ran = list(job.todo), 0
    for batch_size in dict.fromkeys((options.batch_size, 1)):
        if not pending:
            return
        done = set()
        for record in _run_lines(ray, job, pending, dataclasses.replace(options, batch_size=batch_size), actor, actor_kwargs):
            done.add(record["key"])
            yield record
        num_ran += len(done)
        pending = [line for line in pending if line.key not in done]
    if num_ran == 0 and len(pending) > 1:  # not one line ran, alone or in a batch: the actors cannot run at all
        raise RuntimeError(f"every batch failed on Ray ({len(pending)} lines, none ran): see the actors' errors in the Ray logs (`ray logs`)")
    attempts = 1 + options.max_retries
    times = f"{attempts} time{'s' if attempts > 1 else ''}"
    for line in pending:
        yield error_record(line, f"its Ray actor died running it ({times}, alone in its batch: a crash, or out of memory; --ray-max-retries); the other lines ran", 500)


def _run_lines(ray, job: "BatchJob", lines: list, options: RayOptions, actor: type, actor_kwargs: dict) -> Iterator[dict]:
    items = [{"line": line_to_json(line)} for line in lines]
    ds = ray.data.from_items(items, override_num_blocks=math.ceil(len(items) / options.batch_size))
    ds = ds.map_batches(
        actor, batch_size=options.batch_size, batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=options.num_actors, max_tasks_in_flight_per_actor=1),  # a crash takes only its own batch down
        num_cpus=options.num_cpus, num_gpus=options.num_gpus or None,
        fn_constructor_kwargs=actor_kwargs | {"defaults": job.runner.defaults, "truncate": job.runner.truncate},
        max_restarts=-1, max_task_retries=options.max_retries,  # Ray Data passes extra keywords to the actors as their remote args
    )
    for row in ds.iter_rows():
        yield json.loads(row["record"])
