"""Reasoning output: a thinking block's tokens, its budget, and the split of a text into reasoning and answer.
Host only: imports the stdlib, never jax.

A model thinks when its tokenizer has a pair of thinking tags as single tokens (`THINK_TAGS`: Qwen3's and
DeepSeek-R1's `<think>`/`</think>`, and the others listed). A request's `Thinking` starts from its prompt:
inside the block when the prompt's last tag opens it (a template that writes `<think>\\n` into the
generation prompt), after it when the last tag closes it (Qwen3 with `enable_thinking=False`), and
otherwise before it, where the first output token may open it. Rules, each with one owner here:

- `Thinking.advance` (called once per output token by the output processor) moves the state;
- `Thinking.forced_token`: with `SamplingParams.thinking_budget` N, the close tag is the only token allowed
  once N tokens were generated inside the block (guided.Guide.fill_mask applies it);
- `Thinking.grammar_applies`: a request's grammar masks and consumes only the tokens after the close tag;
- `split(text, thinking)`: (reasoning_content, content) of a finished request's text.
"""

import dataclasses

# (open, close) tag pairs a tokenizer may carry as single tokens, most common first.
THINK_TAGS = (
    ("<think>", "</think>"),  # Qwen3, QwQ, DeepSeek-R1, SmolLM3, Phi-4-reasoning
    ("<seed:think>", "</seed:think>"),  # Seed-OSS
    ("[THINK]", "[/THINK]"),  # Magistral
    ("\u25c1think\u25b7", "\u25c1/think\u25b7"),  # Kimi
    ("<|START_THINKING|>", "<|END_THINKING|>"),  # Command A Reasoning
)

BEFORE, THINKING, ANSWER = "before", "thinking", "answer"


@dataclasses.dataclass(frozen=True)
class ThinkTokens:
    """A model's thinking tags: their ids and their text."""

    open_id: int
    close_id: int
    open_text: str
    close_text: str


def think_tokens(token_to_id) -> ThinkTokens | None:
    """The first pair of THINK_TAGS whose both tags are single tokens (`token_to_id(text) -> id or None`,
    e.g. a `tokenizers.Tokenizer.token_to_id`); None when the model has none (it does not think)."""
    for open_text, close_text in THINK_TAGS:
        open_id, close_id = token_to_id(open_text), token_to_id(close_text)
        if open_id is not None and close_id is not None:
            return ThinkTokens(open_id, close_id, open_text, close_text)
    return None


def start_state(tokens: ThinkTokens, prompt_ids) -> str:
    """Where a request starts: THINKING when the prompt's last tag opens a block, ANSWER when it closes one,
    else BEFORE (its first output token may open one)."""
    for token in reversed(prompt_ids):
        if token == tokens.open_id:
            return THINKING
        if token == tokens.close_id:
            return ANSWER
    return BEFORE


@dataclasses.dataclass
class Thinking:
    """One request's place relative to its thinking block (each sample of n has its own).

    `budget`: tokens generated inside the block after which the close tag is forced (None: no limit).
    `num_thinking_tokens` counts the tokens generated inside the block (neither tag counted).
    """

    tokens: ThinkTokens
    state: str
    budget: int | None = None
    num_thinking_tokens: int = 0
    opened_in_output: bool = False  # the first output token opened the block
    started_inside: bool = False  # the prompt opened the block (set by `thinking_for`)
    last_was_thinking: bool = False  # the latest token advanced belongs to the block (its tags included)

    def advance(self, token: int) -> None:
        """Feed one output token."""
        self.last_was_thinking = self.state != ANSWER
        if self.state == BEFORE:
            self.opened_in_output = token == self.tokens.open_id
            self.state = THINKING if self.opened_in_output else ANSWER
            self.last_was_thinking = self.opened_in_output
        elif self.state == THINKING:
            if token == self.tokens.close_id:
                self.state = ANSWER
            else:
                self.num_thinking_tokens += 1

    @property
    def grammar_applies(self) -> bool:
        """Whether the next token is the answer's, which a grammar constrains (BEFORE: it is, unless it opens
        the block, which guided.Guide allows beside the grammar's tokens)."""
        return self.state != THINKING

    @property
    def forced_token(self) -> int | None:
        """The close tag's id when the budget is spent inside the block (the only token allowed), else None."""
        if self.state == THINKING and self.budget is not None and self.num_thinking_tokens >= self.budget:
            return self.tokens.close_id
        return None


def thinking_for(tokens: ThinkTokens | None, prompt_ids, budget: int | None) -> Thinking | None:
    """A request's Thinking from its prompt, or None for a model that does not think."""
    if tokens is None:
        return None
    state = start_state(tokens, prompt_ids)
    return Thinking(tokens, state, budget, started_inside=state == THINKING)


def split(text: str, thinking: Thinking | None) -> tuple[str | None, str]:
    """(reasoning_content, content) of a finished request's text: the text inside the block (its tags
    left out) and the text after its close tag. A block never closed is all reasoning; a request that never
    thought (no Thinking, a prompt that closed the block, a first token that did not open it) has
    reasoning_content None. The tags must be in the text: they are, unless a tokenizer marks them special."""
    if thinking is None or not (thinking.started_inside or thinking.opened_in_output):
        return None, text
    tags, body_start = thinking.tokens, 0
    if thinking.opened_in_output and (start := text.find(tags.open_text)) >= 0:
        body_start = start + len(tags.open_text)
    end = text.find(tags.close_text, body_start)
    if end < 0:
        return text[body_start:], ""
    return text[body_start:end], text[end + len(tags.close_text):]
