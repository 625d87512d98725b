"""An lm-evaluation-harness model over `LLM`: `loglikelihood`, `loglikelihood_rolling`, `generate_until`.

Registered as "jaxinfer": lazily in lm-eval's own table by `jaxinfer.lm_eval_hook` (installed with the
package through `jaxinfer_lm_eval.pth`), so lm-eval's CLI finds it by name, and with `register_model` when this
module is imported. Where .pth files are not read, this module is the CLI, registering the model and handing
lm-eval's own arguments to its CLI:

    lm_eval --model jaxinfer --model_args model=PATH,dtype=float32 --tasks ...
    python -m jaxinfer.lm_eval_model --model jaxinfer ...   (without the .pth file)
    jaxinfer-lm-eval --model jaxinfer ...                   (the same, as a console script)

`model_args` are LLM's keywords (model, dtype, quantization, tensor_parallel, EngineConfig fields such as
deterministic=True) plus `max_gen_toks` (generate_until's default, 256). Log-likelihoods go through
scoring.score_pairs: each context is prefilled once and shared by its continuations through the prefix
cache; a pair over the context is cut from the context's start, as lm-eval's HF model cuts it. Needs the
`eval` extra (lm-eval); nothing in jaxinfer imports this module.
"""

import lm_eval.models  # noqa: F401  (lm-eval's own model table, before ours is added to the registry)
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from jaxinfer import scoring
from jaxinfer.api import LLM
from jaxinfer.scheduling.request import SamplingParams

_NOT_LLM_ARGS = ("batch_size", "max_batch_size", "device")  # lm-eval's own settings, passed to every model


@register_model("jaxinfer")
class JaxinferLM(TemplateLM):
    """lm-eval's model interface over one `LLM` (or an LLM given as `llm=`)."""

    def __init__(self, model=None, *, llm: LLM | None = None, max_gen_toks: int = 256, **llm_args):
        super().__init__()
        for name in _NOT_LLM_ARGS:
            llm_args.pop(name, None)
        self.llm = llm if llm is not None else LLM(model, **llm_args)
        self.model_name = str(model)
        self.max_gen_toks = int(max_gen_toks)
        self.backend = "causal"

    @property
    def eot_token_id(self) -> int:
        eos = self.llm.tokenizer.eos_id
        return eos if eos is not None else 0

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is conditioned on: BOS where the model has one, else EOS (as lm-eval's HF model)."""
        bos = getattr(self.llm.tokenizer, "bos_id", None)
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self.llm.engine_config.max_context - 1  # a prompt leaves one slot of the context

    @property
    def tokenizer_name(self) -> str:
        return self.model_name.replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.llm.tokenizer.apply_chat_template(chat_history, add_generation_prompt=add_generation_prompt)

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        """Token ids of `string`; add_special_tokens=False (lm-eval's for a continuation alone) adds no BOS."""
        if not string:
            return []
        if add_special_tokens is False:
            return self.llm.encode(self.llm.tokenizer.encode(string, add_bos=False))
        return self.llm.encode(string)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(log-probability, is_greedy) per ((context, continuation), context ids, continuation ids)."""
        pairs = [_fit(context, continuation, self.max_length) for _, context, continuation in requests]
        results = scoring.score_pairs(self.llm, pairs, progress=not disable_tqdm)
        answers = [(r.logprob, r.is_greedy) for r in results]
        for request, answer in zip(requests, answers):
            if request[0] is not None:
                self.cache_hook.add_partial("loglikelihood", request[0], answer)
        return answers

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """A whole text's log-likelihood in disjoint windows of at most max_length tokens (lm-eval's rolling
        windows, each with as much context before it as fits)."""
        windows, owners = [], []
        for index, request in enumerate(requests):
            (text,) = request.args
            rolling = get_rolling_token_windows(token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length - 1, context_len=1)
            for context, continuation in map(make_disjoint_window, rolling):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)):
            totals[owner] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (request.args[0],), total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, with do_sample) text up to the first `until` string, as LLM.generate gives it."""
        prompts, params = [], []
        for request in requests:
            context, gen_kwargs = request.args
            sp = self.sampling_params(gen_kwargs)
            prompts.append(self.llm.encode(context)[-max(1, self.max_length - sp.max_tokens):])  # room for the output
            params.append(sp)
        outputs = self.llm.generate(prompts, params, progress=not disable_tqdm)
        texts = [output.text for output in outputs]
        for request, text in zip(requests, texts):
            self.cache_hook.add_partial("generate_until", request.args, text)
        return texts

    def sampling_params(self, gen_kwargs: dict) -> SamplingParams:
        """lm-eval's generation kwargs as SamplingParams: until -> stop, max_gen_toks -> max_tokens,
        temperature (with do_sample; greedy without), top_p, top_k and seed where given."""
        kwargs = dict(gen_kwargs or {})
        until = kwargs.pop("until", None) or ()
        until = (until,) if isinstance(until, str) else tuple(until)
        max_tokens = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
        temperature = float(kwargs.pop("temperature", 1.0)) if kwargs.pop("do_sample", False) else 0.0  # greedy unless sampling
        fields = {name: kwargs[name] for name in ("top_p", "top_k", "seed") if name in kwargs and temperature > 0}
        return SamplingParams(temperature=temperature, max_tokens=max_tokens, stop=until, **fields)


def _fit(context: list[int], continuation: list[int], max_length: int) -> tuple[list[int], list[int]]:
    """A pair cut to max_length tokens from the context's start (at least one context token stays, and
    only a continuation longer than the whole context loses its own first tokens, unscored)."""
    whole = (context + continuation)[-max_length:]
    num_context = max(1, len(whole) - len(continuation))
    return whole[:num_context], whole[num_context:]


def main() -> None:
    """lm-eval's CLI with the "jaxinfer" model registered (`python -m jaxinfer.lm_eval_model ...`)."""
    from lm_eval.__main__ import cli_evaluate  # noqa: PLC0415  (its CLI only when run as one)

    cli_evaluate()


if __name__ == "__main__":
    main()
