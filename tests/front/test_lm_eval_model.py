"""The lm-eval model over LLM, on local tasks (YAML with `dataset_path: json` over files written here; nothing is
downloaded): a multiple-choice task's accuracy equals the one computed directly over LLM.score, its
generate_until answers equal LLM.generate's texts, loglikelihood_rolling equals a direct sum over windows,
and lm-eval's own CLI, `lm_eval --model jaxinfer`, finds the model by name (through the installed .pth hook)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("lm_eval", reason="the eval extra (lm-eval) is not installed")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lm_eval  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from jaxinfer.lm_eval_model import JaxinferLM  # noqa: E402
from jaxinfer.scheduling.request import SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
QUESTIONS = [
    ("The capital of France is", ["Paris", "London", "Berlin", "Madrid"], 0),
    ("The largest planet in the solar system is", ["Mars", "Jupiter", "Venus"], 1),
    ("Water freezes at zero degrees", ["Fahrenheit", "Kelvin", "Celsius"], 2),
    ("The opposite of hot is", ["cold", "warm", "loud", "green"], 0),
    ("A week has seven", ["months", "days", "years"], 1),
    ("Bees make", ["milk", "honey", "silk"], 1),
    ("The sun rises in the", ["west", "north", "east"], 2),
    ("Two plus two equals", ["four", "five", "three"], 0),
]
PROMPTS = [("Q: What colour is the sky?\nA:", "blue"), ("Q: How many legs does a cat have?\nA:", "four"), ("Once upon a time", "there")]


def write_tasks(folder: Path) -> Path:
    """Two local tasks: a multiple-choice one and a generation one, over JSON lines files."""
    folder.mkdir(parents=True, exist_ok=True)
    mc, gen = folder / "mc.jsonl", folder / "gen.jsonl"
    mc.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    gen.write_text("".join(json.dumps({"prompt": p, "target": t}) + "\n" for p, t in PROMPTS))
    (folder / "jaxinfer_mc.yaml").write_text(
        "task: jaxinfer_mc\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {mc}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n"
    )
    (folder / "jaxinfer_gen.yaml").write_text(
        "task: jaxinfer_gen\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {gen}\n"
        "test_split: test\noutput_type: generate_until\n"
        'doc_to_text: "{{prompt}}"\ndoc_to_target: "{{target}}"\n'
        'generation_kwargs:\n  until: ["\\n", "."]\n  max_gen_toks: 12\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n"
    )
    return folder


@pytest.fixture(scope="module")
def results(smollm2_llm, tmp_path_factory):
    tasks = write_tasks(tmp_path_factory.mktemp("tasks"))
    model = JaxinferLM(llm=smollm2_llm, max_gen_toks=12)
    return lm_eval.simple_evaluate(model=model, tasks=["jaxinfer_mc", "jaxinfer_gen"], task_manager=TaskManager(include_path=str(tasks)), log_samples=True)


def test_multiple_choice_accuracy_equals_a_direct_computation_over_score(results, smollm2_llm):
    correct = []
    for question, choices, answer in QUESTIONS:
        scores = smollm2_llm.score(question, [" " + choice for choice in choices])  # lm-eval's target delimiter is a space
        correct.append(int(np.argmax([s.logprob for s in scores])) == answer)
    assert results["results"]["jaxinfer_mc"]["acc,none"] == pytest.approx(np.mean(correct), abs=1e-12)
    assert np.mean(correct) > 0.5  # the real model knows most of these: the comparison is not of two chance rates
    for sample in results["samples"]["jaxinfer_mc"]:  # and each choice's log-likelihood is the direct one
        question, choices, _ = QUESTIONS[sample["doc_id"]]
        direct = [s.logprob for s in smollm2_llm.score(question, [" " + c for c in choices])]
        assert [float(r[0]) for r in sample["filtered_resps"]] == pytest.approx(direct, abs=1e-5)


def test_generate_until_gives_the_text_of_llm_generate(results, smollm2_llm):
    params = SamplingParams(temperature=0, max_tokens=12, stop=("\n", "."))
    expected = [output.text for output in smollm2_llm.generate([p for p, _ in PROMPTS], params)]
    by_doc = {sample["doc_id"]: sample["resps"][0][0] for sample in results["samples"]["jaxinfer_gen"]}
    assert [by_doc[i] for i in range(len(PROMPTS))] == expected
    assert any(expected)  # something was generated


def test_loglikelihood_rolling_sums_disjoint_windows_with_as_much_context_as_fits(smollm2_llm):
    model = JaxinferLM(llm=smollm2_llm)
    text = " ".join(["The quick brown fox jumps over the lazy dog."] * 40)  # longer than the 256-token context
    ids = smollm2_llm.encode(text)
    assert len(ids) > model.max_length
    (total,) = model.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)], disable_tqdm=True)
    first = smollm2_llm.score([model.prefix_token_id], [ids[: model.max_length - 1]])[0]
    rest = ids[model.max_length - 1 :]
    context = ids[: model.max_length - 1][-(model.max_length - len(rest)) :]
    second = smollm2_llm.score(context, [rest])[0]
    assert total == pytest.approx(first.logprob + second.logprob, abs=1e-3)


def test_lm_evals_own_cli_finds_the_jaxinfer_model_by_name(tiny_chat_model, compile_cache, tmp_path):
    tasks = write_tasks(tmp_path / "tasks")
    out = tmp_path / "out"
    args = f"model={tiny_chat_model},dtype=float32,max_context=128,page_size=16,max_num_seqs=4,max_prefill_tokens=64,compilation_cache_dir={compile_cache}"
    run = subprocess.run(
        [Path(sys.executable).with_name("lm_eval"), "--model", "jaxinfer", "--model_args", args, "--tasks", "jaxinfer_mc",
         "--include_path", str(tasks), "--output_path", str(out), "--limit", "4"],
        cwd=ROOT, capture_output=True, text=True, timeout=900, env=os.environ | {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    (written,) = out.rglob("results*.json")
    assert 0.0 <= json.loads(written.read_text())["results"]["jaxinfer_mc"]["acc,none"] <= 1.0
