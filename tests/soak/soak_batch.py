"""Does the resumable JSONL batch CLI lose, duplicate or change records when it is killed and resumed?

The input, the goal and the committed run are in docs/benchmarks.md ("soak_batch.py").
--lines seeded lines (about 10% odd or poison, every kind of line_kinds() at least once, each with its
expected status) go through `python -m jaxinfer.cli generate` once uninterrupted (ref.jsonl), then again
(soak.jsonl) under --sigkills / --sigints signals at random record counts and --load-kills during model
load, resumed after each; before the middle resume every compiled kernel in the soak's own cache root is
truncated (--damage-kernel-cache), and the job must run on. Two probes must be refused at once, the output untouched: a second job on the
soak output, and a resume under a changed --temperature and --engine-seed. A crash or timeout of an
invocation is recorded, never raised. Exit 0 when the goal is met, 1 when not, 2 for a bad flag.

    make soak                                        # the default run below, the result in build/soak/
    .venv/bin/python tests/soak/soak_batch.py [--lines 2000] [--sigkills 5] [--sigints 2] [--seed 0]
    .venv/bin/python tests/soak/soak_batch.py --lines 100 --sigkills 1 --sigints 1   # a quick look

A soak, not a unit test: pytest does not collect it (no test_ prefix). Each generated `SoakLine` is raw
bytes with the status it must get; the CLI's own parsed form of a line is jaxinfer.batch.input.InputLine.
It imports nothing from experiments/.
"""

import argparse
import collections
import dataclasses
import json
import os
import pathlib
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = REPO_ROOT / "build" / "soak" / "soak_batch.json"
MAX_CONTEXT = 256  # tokens per sequence; the 400-word prompt is well over it
# --deterministic: a resumed invocation batches the remaining lines differently, and only deterministic mode
# promises the same logits whatever else runs (with the tuner's bf16, 10 of 97 records differed without it).
ENGINE_FLAGS = ("--no-progress", "--deterministic", "--max-context", str(MAX_CONTEXT), "--max-num-seqs", "16", "--page-size", "16")
NUM_OVER_CONTEXT_WORDS = 400
POISON_FRACTION = 0.10  # odd + poison lines, at least one of every kind
NUM_BLANK_LINES = 3
POLL_S = 0.05  # how often the output file is counted while an invocation runs
LOAD_KILL_DELAY_S = (0.3, 3.0)  # after the loading message; a warm load + compile takes longer (~15 s on 2 cores)
LOAD_FALLBACK_S = 10.0  # a CLI silent on stderr this long is taken to be loading
COMPARED_FIELDS = ("status", "token_ids", "text", "error")
MAX_LISTED = 20  # examples kept per list in the report
DEEP_SCHEMA_DEPTH = 1000  # a $defs chain this deep killed the process by SIGSEGV in llguidance's check
DEEP_GRAMMAR_RULES = 4000  # a chained Lark grammar this long did too
EOS_ID = 2  # SmolLM2's <|im_end|>: allowed_token_ids=[EOS] with min_tokens=3 leaves no token to draw

NOUNS = ("river", "castle", "robot", "garden", "violin", "comet", "library", "forest", "teacher", "dragon",
         "bicycle", "ocean", "market", "lantern", "volcano", "penguin", "bridge", "kitchen", "island", "clock")
ADJECTIVES = ("quiet", "ancient", "curious", "bright", "tiny", "enormous", "gentle", "strange", "happy", "cold")
VERBS = ("builds", "paints", "visits", "repairs", "forgets", "chases", "remembers", "carries", "finds", "sings to")
TEMPLATES = (
    "Write a {adj} sentence about a {noun}.",
    "Explain how a {noun} {verb} a {noun2}.",
    "List three {adj} facts about the {noun}.",
    "Tell me a story about a {adj} {noun} who {verb} a {noun2}.",
    "What is the difference between a {noun} and a {noun2}?",
    "Describe a {adj} {noun} in one line.",
)
CLAUSES = ("Keep it {adj}.", "Mention a {noun} somewhere.", "Imagine the {noun} {verb} a {adj} {noun2}.",
           "Use simple words.", "Make the {noun} the hero.")


@dataclasses.dataclass
class SoakLine:
    """One generated input line and the record status it must get."""

    data: bytes  # the raw line, without its newline
    kind: str
    expect: str  # "ok" | "error" | "either" | "none" (blank: no record)


@dataclasses.dataclass
class Invocation:
    run: str  # "ref" | "soak"
    index: int
    mode: str  # "--overwrite" | "--resume"
    event: str  # "none" | "sigkill" | "sigint" | "load_kill"
    threshold: int | None = None  # records in the output at which the signal is sent
    delay_s: float | None = None  # load_kill: seconds after the CLI starts loading (see _load_started)
    records_before: int = 0
    records_at_signal: int | None = None
    records_after: int = 0
    signal_sent: bool = False
    returncode: int | None = None
    expected_returncode: int = 0
    timed_out: bool = False
    stuck_after_sigint: bool = False
    traceback: bool = False
    seconds: float = 0.0
    seconds_to_first_record: float | None = None
    stderr_tail: list[str] = dataclasses.field(default_factory=list)
    probe_second_job: bool = False  # start a second job on the same output once this one writes (it must be refused)
    probe: dict | None = None  # what that second job did (see _run_probe)
    damaged_kernels: list[str] = dataclasses.field(default_factory=list)  # compiled kernels truncated just before it


def _dumps(obj, ascii_only: bool = False) -> bytes:
    """allow_nan (the default) writes NaN / Infinity as bare tokens, which Python's json reads back."""
    return json.dumps(obj, ensure_ascii=ascii_only).encode("utf-8")


def _prompt_text(rng: random.Random) -> str:
    def fill(template):
        nouns = rng.sample(NOUNS, 2)
        return template.format(adj=rng.choice(ADJECTIVES), noun=nouns[0], noun2=nouns[1], verb=rng.choice(VERBS))

    parts = [fill(rng.choice(TEMPLATES))] + [fill(rng.choice(CLAUSES)) for _ in range(rng.randint(0, 4))]
    return " ".join(parts)  # about 8 to 55 tokens


def _messages(rng: random.Random) -> list[dict]:
    messages = [{"role": "user", "content": _prompt_text(rng)}]
    if rng.random() < 0.2:
        messages = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."}] + messages
    if rng.random() < 0.3:
        messages.insert(0, {"role": "system", "content": f"You are a {rng.choice(ADJECTIVES)} assistant."})
    return messages


def _good_request(rng: random.Random, request_id, *, chat: bool | None = None) -> dict:
    """A valid request; `chat` None draws prompt (60%) or messages (40%)."""
    chat = rng.random() < 0.4 if chat is None else chat
    request = {"id": request_id, "messages": _messages(rng)} if chat else {"id": request_id, "prompt": _prompt_text(rng)}
    request["max_tokens"] = rng.randint(4, 16)
    if rng.random() < 0.5:
        return request | {"temperature": 0}
    request["temperature"] = round(rng.uniform(0.7, 1.0), 3)
    if rng.random() < 0.5:
        request["seed"] = rng.randrange(2**31)
    if rng.random() < 0.3:
        request.update(rng.choice(({"top_k": 20}, {"top_k": 50}, {"top_p": 0.9})))
    return request


def _with(base: dict, drop: tuple[str, ...] = (), **fields) -> dict:
    return {**{k: v for k, v in base.items() if k not in drop}, **fields}


def _field_poison(base: dict) -> dict[str, tuple[str, dict]]:
    """Lines that are valid JSON objects with one bad (or odd) field: kind -> (expect, object)."""
    return {
        "missing_id": ("error", _with(base, drop=("id",))),
        "id_bool": ("error", _with(base, id=True)),
        "id_float": ("error", _with(base, id=1.5)),
        "id_object": ("error", _with(base, id={"name": base["id"]})),
        "missing_prompt": ("error", _with(base, drop=("prompt",))),
        "empty_prompt": ("error", _with(base, prompt="")),
        "prompt_and_messages": ("error", _with(base, messages=[{"role": "user", "content": "Hi"}])),
        "messages_not_list": ("error", _with(base, drop=("prompt",), messages=base["prompt"])),
        "message_without_content": ("error", _with(base, drop=("prompt",), messages=[{"role": "user"}])),
        "stop_not_string": ("error", _with(base, stop=[1])),
        "stop_empty_string": ("error", _with(base, stop=[""])),
        "top_k_overflow": ("error", _with(base, top_k=2**31)),
        "temperature_nan": ("error", _with(base, temperature=float("nan"))),
        "temperature_infinity": ("error", _with(base, temperature=float("inf"))),
        "temperature_negative": ("error", _with(base, temperature=-1)),
        "top_p_zero": ("error", _with(base, top_p=0)),
        "max_tokens_zero": ("error", _with(base, max_tokens=0)),
        "max_tokens_bool": ("error", _with(base, max_tokens=True)),
        "stop_token_ids_string": ("error", _with(base, stop_token_ids=["5"])),
        "stop_token_ids_float": ("error", _with(base, stop_token_ids=[1.5])),
        "stop_token_ids_huge": ("error", _with(base, stop_token_ids=[10**9])),
        "stop_token_ids_negative": ("error", _with(base, stop_token_ids=[-1])),
        "seed_negative": ("error", _with(base, seed=-1)),
        "seed_huge": ("error", _with(base, seed=2**40)),
        "deadline_nan": ("either", _with(base, deadline_s=float("nan"))),
        "deadline_negative": ("either", _with(base, deadline_s=-1)),
        "unknown_field_typo": ("either", _with(base, drop=("max_tokens",), max_token=5)),
        # grammars that crash llguidance's checker (a native stack overflow) and constraints that leave no token
        "deep_json_schema": ("error", _with(base, guided_json=_defs_chain_schema(DEEP_SCHEMA_DEPTH))),
        "deep_lark_grammar": ("error", _with(base, guided_grammar=_lark_chain(DEEP_GRAMMAR_RULES))),
        "empty_language_grammar": ("error", _with(base, guided_grammar='start: x\nx: x "a"')),
        "impossible_constraints": ("error", _with(base, allowed_token_ids=[EOS_ID], min_tokens=3)),
        "null_sampling_fields": ("either", _with(base, temperature=None, top_p=None, stop=None, logit_bias=None)),
    }


def _defs_chain_schema(depth: int) -> dict:
    """A JSON schema whose `$defs` chain each object to the next, `depth` deep (75 KB at 1,000)."""
    defs = {f"d{i}": {"type": "object", "properties": {"next": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["next"]} for i in range(depth)}
    return {"$ref": "#/$defs/d0", "$defs": defs | {f"d{depth}": {"type": "integer"}}}


def _lark_chain(rules: int) -> str:
    """A Lark grammar of `rules` rules, each naming the next, ending in "a"."""
    return "\n".join(["start: r0", *(f"r{i}: r{i + 1}" for i in range(rules)), f'r{rules}: "a"'])


def _text_poison(rng: random.Random, base: dict) -> dict[str, tuple[str, bytes]]:
    """Lines whose bytes or text are the point: kind -> (expect, raw line)."""
    words = " ".join(rng.choice(NOUNS) for _ in range(NUM_OVER_CONTEXT_WORDS))
    half = len(base["prompt"]) // 2
    odd = {name: base["prompt"][:half] + char + base["prompt"][half:]
           for name, char in (("u2028", "\u2028"), ("u2029", "\u2029"), ("u0085", "\u0085"))}
    return {
        "malformed_json": ("error", rng.choice((_dumps(base)[:-9], _dumps(base)[:-1] + b",}", b"{'id': 'x', 'prompt': 'hi'}"))),
        "json_array": ("error", _dumps([base["id"], base["prompt"]])),
        "prompt_over_context": ("error", _dumps(_with(base, prompt=words))),
        "lone_surrogate": ("error", _dumps(_with(base, prompt="\ud800"), ascii_only=True)),  # the \\ud800 escape
        "invalid_utf8": ("error", _dumps(_with(base, prompt="PLACEHOLDER")).replace(b"PLACEHOLDER", b"caf\xff au lait")),
        **{f"raw_{name}_in_prompt": ("ok", _dumps(_with(base, prompt=text))) for name, text in odd.items()},
    }


def _single_line_kinds(rng: random.Random, request_id: str) -> dict[str, tuple[str, bytes]]:
    base = _good_request(rng, request_id, chat=False)
    return {kind: (expect, _dumps(obj)) for kind, (expect, obj) in _field_poison(base).items()} | _text_poison(rng, base)


def _poison_group(rng: random.Random, kind: str, request_id: str) -> list[SoakLine]:
    """One occurrence of `kind`: one line, or the two lines of a pair (kept in this order)."""
    pairs = {"duplicate_id": ((request_id, "duplicate_id_first", "ok"), (request_id, "duplicate_id_second", "error")),
             "ids_1_and_string_1": ((1, "id_int_1", "ok"), ("1", "id_string_1", "ok"))}
    if kind in pairs:
        return [SoakLine(_dumps(_good_request(rng, line_id)), line_kind, expect) for line_id, line_kind, expect in pairs[kind]]
    if kind == "blank_line":
        return [SoakLine(rng.choice((b"", b"   ", b"\t")), "blank_line", "none")]
    expect, data = _single_line_kinds(rng, request_id)[kind]
    return [SoakLine(data, kind, expect)]


def line_kinds() -> list[str]:
    """Every odd/poison kind --exclude-kinds accepts; the first three are not repeated."""
    return ["bom_first_line", "ids_1_and_string_1", "blank_line", "duplicate_id", *_single_line_kinds(random.Random(0), "x")]


def _special_groups(rng: random.Random, num_lines: int, excluded: set[str]) -> list[list[SoakLine]]:
    """Every odd/poison kind once, then repeats (not of the once-only ones) up to POISON_FRACTION."""
    repeatable = [kind for kind in line_kinds()[3:] if kind not in excluded]
    kinds = repeatable + [kind for kind in ("ids_1_and_string_1",) if kind not in excluded]
    kinds += ["blank_line"] * (NUM_BLANK_LINES if "blank_line" not in excluded else 0)
    groups = [_poison_group(rng, kind, f"odd-{n:05d}") for n, kind in enumerate(kinds)]
    while sum(len(group) for group in groups) < POISON_FRACTION * num_lines:
        groups.append(_poison_group(rng, rng.choice(repeatable), f"odd-{len(groups):05d}"))
    return groups


def build_input(num_lines: int, seed: int, excluded: frozenset[str] = frozenset()) -> list[SoakLine]:
    """num_lines lines; line 1 is a good request behind a UTF-8 BOM (unless excluded)."""
    rng = random.Random(seed)
    groups = _special_groups(rng, num_lines, excluded)
    num_special = sum(len(group) for group in groups)
    if num_special + 2 > num_lines:
        raise ValueError(f"--lines must be at least {num_special + 2} to hold every kind of line")
    slots = sorted(rng.sample(range(1, num_lines), num_special))  # line 0 holds the BOM line
    rng.shuffle(groups)
    lines: list[SoakLine | None] = [None] * num_lines
    for slot, line in zip(slots, [line for group in groups for line in group]):  # each pair keeps its order: slots are sorted
        lines[slot] = line
    for slot in range(num_lines):
        if lines[slot] is None:
            request_id = 100_000 + slot if rng.random() < 0.15 else f"req-{slot:05d}-{rng.choice(NOUNS)}"
            lines[slot] = SoakLine(_dumps(_good_request(rng, request_id)), "good", "ok")
    if "bom_first_line" not in excluded:
        lines[0] = SoakLine(b"\xef\xbb\xbf" + lines[0].data, "bom_first_line", "ok")
    return lines


def _output_bytes(path: pathlib.Path) -> bytes:
    return path.read_bytes() if path.exists() else b""


def _count_records(path: pathlib.Path) -> int:
    """Complete (newline-terminated) lines in the output; a torn last line does not count."""
    return _output_bytes(path).count(b"\n")


def _load_started(stderr_path: pathlib.Path, elapsed: float) -> bool:
    """The CLI prints "loading ... compiling the engine's programs..." to stderr once its imports are done;
    a CLI that prints nothing is taken to be loading after LOAD_FALLBACK_S."""
    return elapsed >= LOAD_FALLBACK_S or stderr_path.stat().st_size > 0


def _should_signal(inv: Invocation, num_records: int, since_load: float | None) -> bool:
    if inv.event == "none" or inv.signal_sent:
        return False
    if inv.event == "load_kill":  # fire at the delay, or at once if a record shows up first (reported)
        return (since_load is not None and since_load >= inv.delay_s) or num_records > inv.records_before
    # At least one new record, so the signal lands after the model is loaded, never during imports.
    return num_records >= inv.threshold and num_records > inv.records_before


def _send_signal(proc: subprocess.Popen, inv: Invocation, num_records: int, grace_s: float) -> None:
    inv.signal_sent, inv.records_at_signal = True, num_records
    inv.expected_returncode = 130 if inv.event == "sigint" else -signal.SIGKILL  # sigkill, load_kill
    if inv.event != "sigint":
        proc.kill()
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        inv.stuck_after_sigint = True
        proc.kill()


def _watch(proc: subprocess.Popen, inv: Invocation, output: pathlib.Path, paths: dict, stderr_path: pathlib.Path, args) -> None:
    """Poll until the process exits; send the invocation's signal when its trigger is reached."""
    start, load_start = time.perf_counter(), None
    while proc.poll() is None:
        elapsed = time.perf_counter() - start
        num_records = _count_records(output)
        if inv.seconds_to_first_record is None and num_records > inv.records_before:
            inv.seconds_to_first_record = round(elapsed, 3)
        if load_start is None and _load_started(stderr_path, elapsed):
            load_start = elapsed
        if elapsed > args.timeout_s:
            inv.timed_out = True
            proc.kill()
        elif inv.probe_second_job and inv.probe is None and num_records > inv.records_before:  # before its signal
            inv.probe = _run_probe("second_job", f"in use by another jaxinfer job (pid {proc.pid})", output, paths, may_grow=True)
        elif _should_signal(inv, num_records, None if load_start is None else elapsed - load_start):
            _send_signal(proc, inv, num_records, args.sigint_grace_s)
        time.sleep(POLL_S)


def _run_probe(name: str, expected_text: str, output: pathlib.Path, paths: dict, extra: tuple = (), *, may_grow=False) -> dict:
    """A resume that must be refused at once (exit 2, `expected_text` on stderr) without touching the output: a
    second job while one runs on the output (naming the first's pid, leaving every record to it: with `may_grow`
    the output may only grow, by the first job's appends), or a resume under another --temperature and --engine-seed
    (listing them, leaving the output byte for byte as it was)."""
    before = _output_bytes(output)
    start = time.perf_counter()
    result = subprocess.run([*_command(paths, output, "--resume"), *extra], cwd=paths["workdir"], stdin=subprocess.DEVNULL,
                            capture_output=True, text=True, timeout=300)
    seconds, after = round(time.perf_counter() - start, 3), _output_bytes(output)
    return {"name": name, "returncode": result.returncode, "seconds": seconds, "stderr": result.stderr.strip()[-3000:],
            "output_unchanged": after.startswith(before) if may_grow else after == before, "expected_text": expected_text}


def _command(paths: dict, output: pathlib.Path, mode: str) -> list[str]:
    return [sys.executable, "-m", "jaxinfer.cli", "generate", "--input", str(paths["input"]), "--output", str(output),
            mode, *ENGINE_FLAGS, "--compile-cache", str(paths["compile_cache"])]


def run_invocation(inv: Invocation, output: pathlib.Path, paths: dict, args) -> Invocation:
    """Runs one CLI invocation to its end (own exit, signal, or timeout); never raises for its failures."""
    stdout_path, stderr_path = (paths["workdir"] / f"{inv.run}-{inv.index:02d}.{ext}" for ext in ("stdout", "stderr"))
    inv.records_before = _count_records(output)
    start = time.perf_counter()
    with open(stdout_path, "wb") as stdout, open(stderr_path, "wb") as stderr:
        env = {**os.environ, "JAXINFER_CACHE_DIR": str(paths["cache_root"])}  # kernels and tuning: the soak's own, to be damaged
        proc = subprocess.Popen(_command(paths, output, inv.mode), cwd=paths["workdir"], stdin=subprocess.DEVNULL, env=env,
                                stdout=stdout, stderr=stderr, start_new_session=True)  # our Ctrl-C is not its
        try:
            _watch(proc, inv, output, paths, stderr_path, args)
        finally:
            if proc.poll() is None:  # this script itself was interrupted
                proc.kill()
            proc.wait()
    inv.seconds, inv.returncode = round(time.perf_counter() - start, 3), proc.returncode
    inv.records_after = _count_records(output)
    stderr_text = stderr_path.read_text(errors="replace")
    inv.traceback = "Traceback" in stderr_text
    inv.stderr_tail = stderr_text.strip().splitlines()[-4:]
    print(f"  {inv.run} #{inv.index} {inv.mode} {inv.event:<9} rc={inv.returncode} records {inv.records_before}"
          f"->{inv.records_after} in {inv.seconds:.1f}s", file=sys.stderr, flush=True)
    return inv


def _spread_thresholds(count: int, num_expected: int, rng: random.Random) -> list[int]:
    """`count` increasing record counts, one drawn from each of `count` equal strata of 5%..95% of the job."""
    width = 0.9 * num_expected / max(count, 1)
    thresholds, previous = [], 0
    for stratum in range(count):
        low = 0.05 * num_expected + stratum * width
        previous = max(previous + 1, int(rng.uniform(low, low + width)))
        thresholds.append(previous)
    return thresholds


def plan_soak(args, num_expected: int, rng: random.Random) -> list[Invocation]:
    """The soak run's invocations: signalled ones in random order, load kills among them, a final resume."""
    events = ["sigkill"] * args.sigkills + ["sigint"] * args.sigints
    rng.shuffle(events)
    planned = list(zip(events, _spread_thresholds(len(events), num_expected, rng)))
    for _ in range(args.load_kills):
        planned.insert(rng.randint(0, len(planned)), ("load_kill", None))
    planned.append(("none", None))
    return [Invocation("soak", index, "--overwrite" if index == 0 else "--resume", event, threshold,
                       delay_s=round(rng.uniform(*LOAD_KILL_DELAY_S), 3) if event == "load_kill" else None)
            for index, (event, threshold) in enumerate(planned)]


def _parsed(data: bytes, encoding: str):
    """The JSON value of one line, or None if it is not UTF-8 or not JSON."""
    try:
        return json.loads(data.decode(encoding))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None


def read_records(path: pathlib.Path) -> tuple[list[dict], dict]:
    """Records of a JSONL output, split on b'\\n' only; unparseable lines (or not objects) and a torn tail are counted."""
    *complete, tail = _output_bytes(path).split(b"\n")
    records = [record for record in (_parsed(raw, "utf-8") for raw in complete) if isinstance(record, dict)]
    return records, {"num_unparseable_lines": len(complete) - len(records), "torn_tail_bytes": len(tail)}


def record_key(record: dict) -> str:
    """The record's "key" if it has one, else id (typed: 1 and "1" differ) or line number."""
    if isinstance(record.get("key"), str):
        return record["key"]
    return f"id:{json.dumps(record['id'])}" if record.get("id") is not None else f"line:{record.get('line')}"


def _expectation_mismatches(lines: list[SoakLine], by_line: dict) -> list[dict]:
    mismatches = []
    for number, line in enumerate(lines, start=1):
        record = by_line.get(number, [{"status": "missing"}])[0]  # a line's first record
        got = record.get("status")
        if line.expect != "none" and got != line.expect and not (line.expect == "either" and got in ("ok", "error")):
            mismatches.append({"line": number, "kind": line.kind, "expect": line.expect, "got": got, "error": str(record.get("error", ""))[:160]})
    return mismatches


def _unique_ids_to_lines(lines: list[SoakLine]) -> dict[str, int]:
    """json.dumps(id) -> line number, for ids (string or integer) that occur on exactly one line."""
    id_to_lines = collections.defaultdict(list)
    for number, line in enumerate(lines, start=1):
        obj = _parsed(line.data, "utf-8-sig")
        if isinstance(obj, dict) and isinstance(obj.get("id"), (str, int)) and not isinstance(obj["id"], bool):
            id_to_lines[json.dumps(obj["id"])].append(number)
    return {request_id: numbers[0] for request_id, numbers in id_to_lines.items() if len(numbers) == 1}


def group_by_input_line(records: list[dict], lines: list[SoakLine]) -> tuple[dict[int, list[dict]], int]:
    """Input line -> its records, by unique id where there is one, else by the record's "line"; and the count
    of records whose "line" is not the line their id is on."""
    id_to_line = _unique_ids_to_lines(lines)
    by_line, num_wrong_line = collections.defaultdict(list), 0
    for record in records:
        number = id_to_line.get(json.dumps(record.get("id")), record.get("line"))
        num_wrong_line += number != record.get("line")
        by_line[number].append(record)
    return by_line, num_wrong_line


def summarize_output(path: pathlib.Path, lines: list[SoakLine]) -> tuple[dict, list[dict], dict]:
    """Accounting of one output against the input: counts, duplicates, losses, expectations."""
    records, damage = read_records(path)
    non_blank = {number for number, line in enumerate(lines, start=1) if line.expect != "none"}
    by_line, num_wrong_line = group_by_input_line(records, lines)
    duplicate_keys = sorted(key for key, count in collections.Counter(map(record_key, records)).items() if count > 1)
    lost = sorted(non_blank - set(by_line))
    mismatches = _expectation_mismatches(lines, by_line)
    return {
        "num_lines_in": len(non_blank), "num_records_out": len(records), **damage,
        "num_records_by_status": dict(collections.Counter(str(record.get("status")) for record in records)),
        "num_records_with_key_field": sum("key" in record for record in records),
        "num_duplicate_keys": len(duplicate_keys), "duplicate_keys": duplicate_keys[:MAX_LISTED],
        "num_lines_with_several_records": sum(len(group) > 1 for group in by_line.values()),
        "num_lost_lines": len(lost), "lost_lines": [{"line": n, "kind": lines[n - 1].kind} for n in lost[:MAX_LISTED]],
        "num_records_for_unknown_lines": sum(len(by_line[n]) for n in set(by_line) - non_blank),
        "num_records_with_wrong_line": num_wrong_line,
        "num_expectation_mismatches": len(mismatches), "expectation_mismatches": mismatches[:MAX_LISTED],
    }, records, by_line


def compare_outputs(ref_records: list[dict], soak_records: list[dict]) -> dict:
    """Per key (first record of each key): equal status, token_ids, text and error."""
    ref, soak = (dict(reversed([(record_key(r), r) for r in records])) for records in (ref_records, soak_records))  # first wins
    keys, differences = sorted(set(ref) | set(soak)), []
    for key in keys:
        if key not in ref or key not in soak:
            differences.append({"key": key, "fields": ["missing in " + ("soak" if key in ref else "ref")]})
            continue
        fields = [field for field in COMPARED_FIELDS if ref[key].get(field) != soak[key].get(field)]
        if fields:
            differences.append({"key": key, "fields": fields, "ref": _brief(ref[key]), "soak": _brief(soak[key])})
    return {"num_keys": len(keys), "num_differing_keys": len(differences),  # two empty outputs are not "identical": nothing compared
            "identical": bool(keys) and not differences, "differences": differences[:MAX_LISTED]}


def _brief(record: dict) -> dict:
    return {field: str(record.get(field))[:80] for field in COMPARED_FIELDS if field in record}


def _kind_table(lines: list[SoakLine], ref_by_line: dict[int, list[dict]]) -> dict:
    """kind -> {lines, expect, statuses seen in ref}."""
    status_by_line = {number: str(records[0].get("status")) for number, records in ref_by_line.items()}
    table = {}
    for number, line in enumerate(lines, start=1):
        entry = table.setdefault(line.kind, {"num_lines": 0, "expect": line.expect, "ref_statuses": collections.Counter()})
        entry["num_lines"] += 1
        if line.expect != "none":
            entry["ref_statuses"][status_by_line.get(number, "missing")] += 1
    return {kind: {**entry, "ref_statuses": dict(entry["ref_statuses"])} for kind, entry in sorted(table.items())}


def coverage_checks(invocations: list[Invocation]) -> dict:
    """Whether the plan was carried out (reported, not part of the goal: a fast job can finish first)."""
    load_kills = [inv for inv in invocations if inv.event == "load_kill"]
    return {"all_signals_sent": all(inv.signal_sent for inv in invocations if inv.event != "none"),
            "load_kills_before_first_record": all(inv.records_at_signal == inv.records_before for inv in load_kills)}


def goal_checks(ref: dict, soak: dict, comparison: dict, invocations: list[Invocation], probes: list[dict]) -> dict:
    """Goal: N in, N out, 0 lost, 0 duplicated, identical to the uninterrupted run, clean invocations, probes refused."""
    checks = {}
    for name, summary in (("ref", ref), ("soak", soak)):
        checks[f"{name}_n_in_n_out"] = summary["num_records_out"] == summary["num_lines_in"]
        checks[f"{name}_none_lost"] = summary["num_lost_lines"] == 0
        checks[f"{name}_none_duplicated"] = summary["num_duplicate_keys"] == 0 and summary["num_lines_with_several_records"] == 0
        checks[f"{name}_no_damaged_lines"] = summary["num_unparseable_lines"] == 0 and summary["torn_tail_bytes"] == 0
        checks[f"{name}_line_numbers_right"] = summary["num_records_with_wrong_line"] == 0 and summary["num_records_for_unknown_lines"] == 0
    return checks | {
        "soak_identical_to_ref": comparison["identical"],
        "exit_codes_as_expected": all(inv.returncode == inv.expected_returncode for inv in invocations),
        "sigint_exit_130": all(inv.returncode == 130 for inv in invocations if inv.event == "sigint" and inv.signal_sent),
        "no_tracebacks": not any(inv.traceback for inv in invocations),
        "no_timeouts": not any(inv.timed_out or inv.stuck_after_sigint for inv in invocations),
        "ran_on_after_the_kernel_cache_was_damaged": all(inv.returncode == inv.expected_returncode and not inv.traceback
                                                         for inv in invocations if inv.damaged_kernels),
        **{f"{name}_refused": any(p["name"] == name and p["refused"] for p in probes) for name in ("second_job", "changed_settings")},
    }


ACCOUNTING = (("lines in (non-blank)", "num_lines_in"), ("records out", "num_records_out"),
              ("records with a 'key' field", "num_records_with_key_field"), ("duplicate keys", "num_duplicate_keys"),
              ("lines with several records", "num_lines_with_several_records"), ("lost lines", "num_lost_lines"),
              ("records for unknown lines", "num_records_for_unknown_lines"),
              ("records with a wrong line number", "num_records_with_wrong_line"),
              ("unparseable output lines", "num_unparseable_lines"), ("torn tail bytes", "torn_tail_bytes"),
              ("expected-status mismatches", "num_expectation_mismatches"))
PROBE_COLUMNS = [("probe (refused at once, output untouched?)", "<42"), ("rc", "3d"), ("s", "6.1f"), ("refused", "<7"), ("stderr, last line", "<")]
INVOCATION_COLUMNS = [("run", "<5"), ("#", "2d"), ("mode", "<11"), ("event", "<9"), ("trigger", "8"), ("before", "6d"), ("at sig", "6d"),
                      ("after", "6d"), ("rc", "4d"), ("want", "4d"), ("load s", "7.1f"), ("wall s", "7.1f"), ("notes", "<")]
KIND_COLUMNS = [("line kind", "<28"), ("lines", "5d"), ("expect", ">7"), ("ref statuses", "<")]


def _cell(value, spec: str) -> str:
    """One table cell in `spec` ("<5", "6d", "7.1f"): None prints as "-", a string as text; right-aligned unless "<"."""
    align, spec = ("<", spec[1:]) if spec.startswith("<") else (">", spec)
    width = spec.rstrip("dfs%").split(".")[0]
    text = "-" if value is None else value if isinstance(value, str) else format(value, spec)
    return f"{text:{align}{width}}"


def _table(columns: list[tuple[str, str]], rows: list[list]) -> None:
    """A header line, then a line per row."""
    lines = [[header for header, _ in columns], *rows]
    print("\n" + "\n".join(" ".join(_cell(value, spec) for value, (_, spec) in zip(row, columns)) for row in lines))


def _invocation_row(inv: Invocation) -> list:
    notes = [name for name in ("timed_out", "stuck_after_sigint", "traceback") if getattr(inv, name)]
    notes += ["exited before its signal"] if inv.event != "none" and not inv.signal_sent else []
    notes += [f"after {len(inv.damaged_kernels)} kernels were truncated"] if inv.damaged_kernels else []
    trigger = f"{inv.delay_s:.1f}s" if inv.delay_s is not None else inv.threshold
    return [inv.run, inv.index, inv.mode, inv.event, trigger, inv.records_before, inv.records_at_signal, inv.records_after,
            inv.returncode, inv.expected_returncode, inv.seconds_to_first_record, inv.seconds, " ".join(notes)]


def _print_runs(ref: dict, soak: dict, invocations: list[Invocation], probes: list[dict]) -> None:
    """The probes, the accounting of both outputs, and the invocations (with the stderr of failed ones)."""
    _table(PROBE_COLUMNS, [[p["name"], p["returncode"], p["seconds"], str(p["refused"]), (p["stderr"].splitlines() or [""])[-1][:110]]
                           for p in probes])
    by_status = ref["num_records_by_status"], soak["num_records_by_status"]
    statuses = sorted(set(by_status[0]) | set(by_status[1]))
    _table([("accounting", "<34"), ("ref", "8d"), ("soak", "8d")], [[label, ref[field], soak[field]] for label, field in ACCOUNTING]
           + [["records " + s, by_status[0].get(s, 0), by_status[1].get(s, 0)] for s in statuses])
    _table(INVOCATION_COLUMNS, [_invocation_row(inv) for inv in invocations])
    for inv in invocations:
        if inv.returncode not in (0, 130, -signal.SIGKILL) or inv.traceback:
            print("\n".join(f"  {inv.run} #{inv.index} stderr: {text[:150]}" for text in inv.stderr_tail))


def _print_results(kinds: dict, ref: dict, comparison: dict, checks: dict, coverage: dict) -> None:
    """Line kinds and ref's expected-status mismatches, soak vs ref, then the checks and the goal."""
    statuses = {kind: ", ".join(f"{status} {count}" for status, count in sorted(entry["ref_statuses"].items())) for kind, entry in kinds.items()}
    _table(KIND_COLUMNS, [[kind, entry["num_lines"], entry["expect"], statuses[kind]] for kind, entry in kinds.items()])
    for m in ref["expectation_mismatches"]:
        print(f"  ref line {m['line']} {m['kind']}: expected {m['expect']}, got {m['got']} {m['error']}")
    print(f"\nsoak vs ref: {comparison['num_keys']} keys, {comparison['num_differing_keys']} differ")
    for difference in comparison["differences"][:10]:
        print(f"  {difference['key']}: {', '.join(difference['fields'])} {difference.get('ref', '')} vs {difference.get('soak', '')}")
    _table([("ok?", "<4"), ("check", "<")], [["pass" if passed else "FAIL", name] for name, passed in checks.items()]
           + [["yes" if passed else "no", f"{name} (coverage, not in the goal)"] for name, passed in coverage.items()])
    print(f"goal {'met' if all(checks.values()) else 'NOT met'}")


def _comma_list(parser: argparse.ArgumentParser, text: str, choices: list[str], what: str) -> list[str]:
    """The non-empty items of a comma list; a usage error naming `what` if one is not in `choices`."""
    items = [item for item in text.split(",") if item]
    if unknown := sorted(set(items) - set(choices)):
        parser.error(f"unknown {what} {unknown}; choose from {', '.join(choices)}")
    return items


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS, help="the result JSON (default: %(default)s)")
    parser.add_argument("--lines", type=int, default=2000, help="input lines, blank ones included (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the input and the kill plan (default: %(default)s)")
    parser.add_argument("--sigkills", type=int, default=5, help="SIGKILLs at random record counts (default: %(default)s)")
    parser.add_argument("--sigints", type=int, default=2, help="SIGINTs at random record counts (default: %(default)s)")
    parser.add_argument("--load-kills", type=int, default=1, help="SIGKILLs during model load (default: %(default)s)")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="per invocation, then SIGKILL (default: %(default)s)")
    parser.add_argument("--sigint-grace-s", type=float, default=120.0, help="wait for exit after SIGINT (default: %(default)s)")
    parser.add_argument("--workdir", type=pathlib.Path, help="inputs, outputs and logs (default: a new temp dir, removed when the goal is met)")
    parser.add_argument("--compile-cache", type=pathlib.Path, help="XLA cache shared by the invocations (default: WORKDIR/xla_cache)")
    parser.add_argument("--damage-kernel-cache", action=argparse.BooleanOptionalAction, default=True,
                        help="truncate every compiled kernel before the middle resume (default: %(default)s)")
    parser.add_argument("--exclude-kinds", default="", metavar="K1,K2", help="leave out these odd/poison kinds, to isolate a failure")
    args = parser.parse_args()
    args.exclude_kinds = _comma_list(parser, args.exclude_kinds, line_kinds(), "kinds")
    return args


def _prepare_workdir(args, lines: list[SoakLine]) -> dict:
    workdir = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="soak_batch_"))
    workdir.mkdir(parents=True, exist_ok=True)
    paths = {"workdir": workdir, "input": workdir / "input.jsonl", "ref": workdir / "ref.jsonl",
             "soak": workdir / "soak.jsonl", "compile_cache": args.compile_cache or workdir / "xla_cache", "cache_root": workdir / "cache"}
    for name in ("ref", "soak"):  # a reused workdir: the first invocations would count stale records
        paths[name].unlink(missing_ok=True)
    paths["input"].write_bytes(b"\n".join(line.data for line in lines) + b"\n")
    manifest = [{"line": number, "kind": line.kind, "expect": line.expect} for number, line in enumerate(lines, start=1)]
    (workdir / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return paths


def run_all(args, paths: dict, lines: list[SoakLine]) -> tuple[list[Invocation], list[dict]]:
    """The reference run, then the soak run; returns every invocation and the probes (with "refused")."""
    num_expected = sum(line.expect != "none" for line in lines)
    print(f"workdir {paths['workdir']}: {len(lines)} lines, {num_expected} non-blank", file=sys.stderr, flush=True)
    ref = run_invocation(Invocation("ref", 0, "--overwrite", "none"), paths["ref"], paths, args)
    soak = plan_soak(args, num_expected, random.Random(args.seed + 1))
    probed = next(inv for inv in soak if inv.event != "load_kill")  # one that writes records
    probed.probe_second_job = True  # once it writes, a second job tries the same output
    probes, damage_before = [], len(soak) // 2 if args.damage_kernel_cache else None
    for inv in soak:
        if inv.index == damage_before:  # between two resumes: every compiled kernel truncated, as a full disk or a crash leaves it
            inv.damaged_kernels = damage_kernel_cache(paths["cache_root"])
        run_invocation(inv, paths["soak"], paths, args)
        if inv is probed:  # the output now holds records (and a torn tail, if a kill tore one)
            probes.append(_run_probe("changed_settings", "other settings", paths["soak"], paths, ("--temperature", "0.5", "--engine-seed", "7")))
    probes = [inv.probe for inv in soak if inv.probe] + probes
    return [ref] + soak, [p | {"refused": p["returncode"] == 2 and p["expected_text"] in p["stderr"] and p["output_unchanged"]} for p in probes]


def damage_kernel_cache(cache_root: pathlib.Path) -> list[str]:
    """Truncates every compiled CPU kernel under the cache root to half its size; returns their names."""
    damaged = []
    for library in sorted((cache_root / "kernels").glob("*.so")):
        library.write_bytes(library.read_bytes()[: library.stat().st_size // 2])
        damaged.append(library.name)
    print(f"  damaged {len(damaged)} compiled kernels: {damaged}", file=sys.stderr, flush=True)
    return damaged


def _write_result(path: pathlib.Path, doc: dict) -> dict:
    """`doc` as JSON at `path`, with the commit and platform it ran on; returns what was written."""
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=False).stdout.strip()
    doc = {**doc, "machine": {"commit": commit or None, "platform": platform.platform(), "python": platform.python_version()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return doc


def main() -> int:
    args = parse_args()
    start = time.perf_counter()
    try:
        lines = build_input(args.lines, args.seed, frozenset(args.exclude_kinds))
    except ValueError as e:
        print(f"soak_batch: error: {e}", file=sys.stderr)
        return 2
    paths = _prepare_workdir(args, lines)
    invocations, probes = run_all(args, paths, lines)
    ref, ref_records, ref_by_line = summarize_output(paths["ref"], lines)
    soak, soak_records, _ = summarize_output(paths["soak"], lines)
    comparison = compare_outputs(ref_records, soak_records)
    checks, coverage = goal_checks(ref, soak, comparison, invocations, probes), coverage_checks(invocations)
    goal_met, kinds = all(checks.values()), _kind_table(lines, ref_by_line)
    _print_runs(ref, soak, invocations, probes)
    _print_results(kinds, ref, comparison, checks, coverage)
    params = {key: str(value) if isinstance(value, pathlib.Path) else value for key, value in vars(args).items()}
    result = _write_result(args.out, {
        "bench": "soak_batch", "goal_met": goal_met, "checks": checks, "coverage": coverage,
        "parameters": {**params, "workdir": str(paths["workdir"]), "engine_flags": list(ENGINE_FLAGS)},
        "wall_s": round(time.perf_counter() - start, 3), "reference": ref, "soak": soak, "comparison": comparison,
        "line_kinds": kinds, "invocations": [dataclasses.asdict(inv) for inv in invocations], "probes": probes,
    })
    if goal_met and args.workdir is None:
        shutil.rmtree(paths["workdir"], ignore_errors=True)
    print(json.dumps(result))
    return 0 if goal_met else 1


if __name__ == "__main__":
    sys.exit(main())
