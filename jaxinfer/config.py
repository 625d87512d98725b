"""Frozen configuration values and the shared vocabularies; a leaf of the import graph.

`ModelConfig` describes the network. It is hashable and passed to jit as a static argument, so it holds
only shapes and constants, never per-request values. `EngineConfig` (host side) holds what the user gave
and never reaches a traced function; the bucket tables derived from it are `BucketTables.from_config`'s
(scheduling/bucket_tables.py), which the scheduler and the engine call. Converting a Hugging Face
`config.json` dict or GGUF metadata happens once at the edge (`from_hf_config`, loading.py); the rest of
the code never sees dicts. The vocabularies (dtypes, impl names, quantizations, int4 group sizes) live
here so that model/, scheduling/ and the front end share them without importing one another.
Imports: the stdlib and `jaxinfer.validation`, nothing else of the package (a test checks it).
"""

import dataclasses
import math
from typing import Any

from jaxinfer.validation import FieldError, check_bool, check_int, check_number, unknown_field_error

ATTENTION_IMPLS = ("auto", "reference", "pallas", "cpu")
# EngineConfig.matmul_impl: XLA dot, panels for the CPU layer-matmul kernel, W8A8 (int8 weights x int8 activations)
# through XLA's int8 dot, or the CPU kernels with quantized weights W8A8 through the quantized-matmul kernel
MATMUL_IMPLS = ("auto", "xla", "cpu", "int8", "cpu_int8")
KV_CACHE_DTYPES = ("int8", "fp8_e4m3")  # quantized KV pools (kv_pool.KV_CODE_FORMATS); None keeps the model dtype

LOGPROBS_MODES = ("raw", "processed")  # EngineConfig.logprobs_mode (vLLM's raw_logprobs / processed_logprobs)
DTYPES = ("float32", "bfloat16", "float16")  # compute dtypes (LoadOptions.dtype, --dtype)
# Weight quantizations, besides None (dense weights in the compute dtype). "auto" (the default): a GGUF file's
# blocks are kept where the runtime tuner may multiply them with the CPU quantized-matmul kernel, and the tuner
# keeps them only if that kernel wins on this machine; everywhere else the weights load dense
# (tuning.load_quantization owns the rule).
QUANTIZATIONS = ("auto", "gguf", "int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128)  # input elements per int4 scale
DEFAULT_INT4_GROUP_SIZE = 32  # SmolLM2's widths (576, 1536) allow 32 or 64, not 128
# EngineConfig's bucket tables that a user may give or leave at None (BucketTables.from_config derives those).
TABLE_FIELDS = ("prefill_chunk_buckets", "decode_batch_buckets", "decode_page_buckets")
# Pages per attention block in deterministic mode (attention.PAGES_PER_BLOCK): its page widths are multiples.
DETERMINISTIC_PAGES_PER_BLOCK = 8
# EngineConfig.policy: the scheduling policies by name (scheduling/policies.py registers one class per name;
# a test checks that the two agree). "fcfs" is the scheduler's own order.
POLICIES = ("fcfs", "shortest-prompt", "edf", "prefix", "adaptive")
EPOCH_POLICIES = ("shortest-prompt", "prefix")  # those that reorder arrivals only within an epoch (EngineConfig.policy_epoch)
# Lines of a lazy input (LLM.stream, a batch job) in flight by default, per max_num_seqs per replica; the simulator and
# whatif pull requests by the same rule
INFLIGHT_PER_SEQ = 4


ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "gemma4")  # HF model_type / GGUF general.architecture families
LAYER_TYPES = ("sliding_attention", "full_attention")  # ModelConfig.layer_types (Hugging Face's names)
HIDDEN_ACTS = ("silu", "gelu_tanh")  # ModelConfig.hidden_act: SwiGLU, or GeGLU with the tanh GELU (Gemma)
ROPE_TYPES = ("linear", "dynamic", "llama3", "yarn", "longrope", "frequency_factors")
HF_ROPE_TYPES = ROPE_TYPES[:-1]  # the rope_type values of a Hugging Face config (besides "default")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """How rotary frequencies are stretched for long contexts (HF `rope_parameters`, llama.cpp `rope_freqs`).

    linear: every frequency divided by `factor`. dynamic (NTK): the base grows with the sequence once it
    passes `original_max_position`. llama3: low frequencies divided by `factor`, high ones kept, a smooth
    blend between (wavelengths measured against `original_max_position`). frequency_factors: one divisor
    per frequency, as llama.cpp stores Llama 3 scaling in a GGUF (`rope_freqs.weight`). yarn: frequencies blended
    between themselves and / factor by their rotations over the original context. longrope (Phi-3/4): `short_factors`
    or, for a row longer than original_max_position, `long_factors`. Both scale cos and sin by `attention_factor`.
    """

    kind: str
    factor: float = 1.0  # context stretch
    low_freq_factor: float = 1.0  # llama3: wavelengths over original_max_position / this are divided by factor
    high_freq_factor: float = 4.0  # llama3: wavelengths under original_max_position / this are kept
    original_max_position: int = 8192  # tokens of the pretraining context (llama3, dynamic)
    frequency_factors: tuple[float, ...] = ()  # frequency_factors: divisor of each of the K/2 frequencies
    attention_factor: float = 1.0  # yarn, longrope: cos and sin times this (so the rotated dims' q.k times its square)
    beta_fast: float = 32.0  # yarn: rotations over the original context above which a frequency is kept
    beta_slow: float = 1.0  # yarn: rotations under which a frequency is divided by factor
    truncate: bool = True  # yarn: the blend's dimension range rounded outward to whole dimensions
    short_factors: tuple[float, ...] = ()  # longrope: divisor of each rotary frequency for rows within the original context
    long_factors: tuple[float, ...] = ()  # longrope: the same for rows past it

    def __post_init__(self):
        if self.kind not in ROPE_TYPES:
            raise ValueError(f"unsupported rope type {self.kind!r}; supported: default, {', '.join(HF_ROPE_TYPES)}")
        check_number("rope factor", self.factor, low=0.0, high=math.inf, low_open=True)
        check_int("original_max_position", self.original_max_position, low=1)
        if self.kind == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(f"llama3 rope needs 0 < low_freq_factor < high_freq_factor, got {self.low_freq_factor}, {self.high_freq_factor}")
        if (self.kind == "frequency_factors") != bool(self.frequency_factors):
            raise ValueError("frequency_factors are given exactly when the rope type is 'frequency_factors'")
        if (self.kind == "longrope") != bool(self.short_factors) or len(self.short_factors) != len(self.long_factors):
            raise ValueError("short_factors and long_factors are given, of one length, exactly when the rope type is 'longrope'")
        check_number("rope attention_factor", self.attention_factor, low=0.0, high=math.inf, low_open=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape, constants and family features of a Llama-family decoder.

    Features are fields (rope scaling, q/k/v biases, q/k norm), each read by one small function of model.py;
    `architecture` only names the family for people and never selects code.
    """

    vocab_size: int  # tokens
    num_layers: int
    embed_dim: int  # D
    ffn_dim: int  # F, SwiGLU hidden width
    num_heads: int  # H, query heads
    num_kv_heads: int  # G, key/value heads (GQA groups)
    head_dim: int  # K
    rotary_dim: int | None = None  # leading dims of each head that rope turns (Phi-4-mini: 3/4 of K); None: all K
    rope_theta: float = 10_000.0  # rotary base
    rope_scaling: RopeScaling | None = None  # None: plain rotary frequencies
    attention_bias: bool = False  # q, k and v projections add a bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm of q and k before rope (Qwen3)
    sliding_window: int | None = None  # tokens a query sees, its own included: keys at t - W < p <= t (Mistral); None: all
    layer_types: tuple[str, ...] | None = None  # per layer, one of LAYER_TYPES (Gemma); None: all windowed when sliding_window is set
    local_rope_theta: float | None = None  # rope base of the sliding layers, unscaled (Gemma); None: as the others
    hidden_act: str = "silu"  # the MLP gate's activation, one of HIDDEN_ACTS
    post_norms: bool = False  # RMSNorm of the attention and MLP outputs before each residual add (Gemma)
    norm_weight_offset: float = 0.0  # HF files hold RMSNorm weights minus this (Gemma 2/3: x * (1 + w)); the HF loader adds it
    embed_scale: float = 1.0  # token embeddings times this, cast to the compute dtype (Gemma: sqrt(embed_dim))
    query_scale: float | None = None  # attention score scale; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    v_norm: bool = False  # RMSNorm of v without a weight (Gemma 4)
    layer_scale: bool = False  # each layer's output times a stored per-layer scalar (Gemma 4's layer_scalar)
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap) (Gemma 2/3/4 where the config has it)
    attn_logit_softcap: float | None = None  # attention scores = cap * tanh(scores / cap), after the scale, before the mask (Gemma 2)
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = True  # logits use the token embedding when True
    max_context: int = 2048  # tokens; positions beyond this are rejected
    dtype: str = "float32"  # compute and weight dtype: float32 | bfloat16 | float16
    architecture: str = "llama"  # family name, one of ARCHITECTURES
    name: str = "llama"

    def __post_init__(self):
        for field in ("vocab_size", "num_layers", "embed_dim", "ffn_dim", "num_heads", "num_kv_heads", "head_dim", "max_context"):
            check_int(field, getattr(self, field), low=1)
        check_number("rope_theta", self.rope_theta, low=0.0, high=math.inf, low_open=True)
        check_number("rms_norm_eps", self.rms_norm_eps, low=0.0, high=1.0)
        if self.attn_logit_softcap is not None:
            check_number("attn_logit_softcap", self.attn_logit_softcap, low=0.0, high=math.inf, low_open=True)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads=} not divisible by {self.num_kv_heads=}")
        if self.head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {self.head_dim=}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r}; supported: {', '.join(ARCHITECTURES)}")
        if self.rotary_dim is not None and (self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim):
            raise ValueError(f"rotary_dim must be even and within head_dim ({self.head_dim}), got {self.rotary_dim}")
        divisors = self.rope_scaling and (self.rope_scaling.frequency_factors or self.rope_scaling.short_factors)
        if divisors and len(divisors) != (self.rotary_dim or self.head_dim) // 2:
            raise ValueError(f"rope has {len(divisors)} frequency factors, expected rotary dims / 2 = {(self.rotary_dim or self.head_dim) // 2}")
        if self.layer_types is not None and (len(self.layer_types) != self.num_layers or not set(self.layer_types) <= set(LAYER_TYPES)):
            raise ValueError(f"layer_types must name one of {LAYER_TYPES} per layer ({self.num_layers}), got {self.layer_types}")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act must be one of {HIDDEN_ACTS}, got {self.hidden_act!r}")
        if self.sliding_window is not None:
            check_int("sliding_window", self.sliding_window, low=1)

    @property
    def group_size(self) -> int:
        """Query heads per kv head."""
        return self.num_heads // self.num_kv_heads

    def features(self) -> dict[str, str]:
        """The family features in words, for `jaxinfer info` and logs."""
        scaling = self.rope_scaling
        return {
            "rope scaling": "none" if scaling is None else f"{scaling.kind} (factor {scaling.factor:g})",
            "q/k/v bias": "yes" if self.attention_bias else "no",
            "q/k norm": "yes" if self.qk_norm else "no",
            "sliding window": "none" if self.sliding_window is None else f"{self.sliding_window} tokens",
            **self._gemma_features(),
        }

    def _gemma_features(self) -> dict[str, str]:
        """The Gemma-style features a config has, in words (none for the Llama-style families)."""
        local = sum(t == "sliding_attention" for t in self.layer_types or ())
        words = {"layer types": self.layer_types and f"{local} sliding, {self.num_layers - local} full",
                 "local rope base": self.local_rope_theta and f"{self.local_rope_theta:g}", "post norms": self.post_norms and "yes",
                 "activation": self.hidden_act != "silu" and self.hidden_act, "logit softcap": self.final_logit_softcap and f"{self.final_logit_softcap:g}",
                 "attention softcap": self.attn_logit_softcap and f"{self.attn_logit_softcap:g}"}
        return {name: text for name, text in words.items() if text}

    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        d, f, k = self.embed_dim, self.ffn_dim, self.head_dim
        attn = d * k * (2 * self.num_heads + 2 * self.num_kv_heads)
        attn += k * (self.num_heads + 2 * self.num_kv_heads) if self.attention_bias else 0
        attn += 2 * k if self.qk_norm else 0
        per_layer = attn + 3 * d * f + 2 * d + (2 * d if self.post_norms else 0) + (d if self.layer_scale else 0)
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.num_layers * per_layer + d + head

    def kv_bytes_per_token(self, dtype_bytes: int | None = None) -> int:
        """Bytes of K and V one token occupies across all layers."""
        width = dtype_bytes or (4 if self.dtype == "float32" else 2)
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * width


def from_hf_config(config: dict[str, Any], *, dtype: str = "float32", max_context: int | None = None) -> ModelConfig:
    """Convert a Hugging Face `config.json` dict (llama, mistral, qwen2, qwen3) to a ModelConfig.

    A Mistral sliding window is kept as `sliding_window`: attention masks keys outside it, and the context
    runs to max_position_embeddings (or `max_context`), past the window.
    """
    if not isinstance(config, dict):
        raise ValueError(f"config.json must hold a JSON object, got {type(config).__name__}")
    if isinstance(config.get("text_config"), dict) and config.get("model_type") in _GEMMA_MULTIMODAL:
        config = {"model_type": f"{config['model_type']}_text", **config["text_config"]}  # the text model of Gemma 3/4 (4B and up)
    model_type = _GEMMA_TEXT_TYPES.get(config.get("model_type", "llama"), config.get("model_type", "llama"))
    if model_type in _HF_GEMMA_CONFIG_DEFAULTS:  # a published config.json (above all a text_config) leaves out transformers' defaults
        config = {**_HF_GEMMA_CONFIG_DEFAULTS[model_type], **config}
    if model_type not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {model_type!r}: jaxinfer loads {', '.join(ARCHITECTURES)}")
    _check_hf_unsupported(config)

    def required(key: str):
        if key not in config:
            raise ValueError(f"config.json has no {key!r}, which a {model_type} model needs")
        return config[key]

    num_heads = required("num_attention_heads")
    embed_dim = required("hidden_size")
    # transformers >= 5 nests rotary settings under `rope_parameters`; older files keep them at top level.
    rope_field = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    rope = config.get(rope_field) or {}
    max_position = int(config.get("max_position_embeddings", 2048))
    window = _hf_sliding_window(config)
    rope = _hf_rope_dict(config, rope, model_type)
    head_dim = config.get("head_dim") or embed_dim // num_heads
    rotary = int(head_dim * float(rope.get("partial_rotary_factor", 1.0)))  # transformers' int(head_dim * partial_rotary_factor)
    fields = dict(
        vocab_size=required("vocab_size"),
        num_layers=required("num_hidden_layers"),
        embed_dim=embed_dim,
        ffn_dim=required("intermediate_size"),
        num_heads=num_heads,
        num_kv_heads=config.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rotary_dim=rotary if model_type in _PARTIAL_ROTARY and rotary != head_dim else None,
        rope_theta=float(config.get("rope_theta") or rope.get("rope_theta") or 10_000.0),
        rope_scaling=rope_scaling_from_hf(rope, max_position, field=rope_field),
        attention_bias=model_type == "qwen2",  # Qwen2 always has q/k/v biases (and none on o)
        qk_norm=model_type == "qwen3",
        sliding_window=window,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        max_context=max_context or max_position,
        dtype=dtype,
        architecture=model_type,
        name=model_type,
    )
    if model_type in _GEMMA_DEFAULTS:
        fields.update(_hf_gemma_fields(config, model_type, max_position, max_context))
    return ModelConfig(**fields)


_GEMMA_TEXT_TYPES = {"gemma3_text": "gemma3", "gemma4_text": "gemma4"}  # HF model_type -> family
_GEMMA_MULTIMODAL = ("gemma3", "gemma4")  # a config with a nested text_config
# transformers 5.24's Gemma2Config / Gemma3TextConfig / Gemma4TextConfig defaults, for keys a config.json omits
_GEMMA_COMMON_DEFAULTS = dict(hidden_size=2304, intermediate_size=9216, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                              rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh")
_HF_GEMMA_CONFIG_DEFAULTS = {
    "gemma2": dict(_GEMMA_COMMON_DEFAULTS, vocab_size=256_000, num_hidden_layers=26, max_position_embeddings=8192, query_pre_attn_scalar=256,
                   sliding_window=4096, final_logit_softcapping=30.0, attn_logit_softcapping=50.0, rope_theta=10_000.0),
    "gemma3": dict(_GEMMA_COMMON_DEFAULTS, vocab_size=262_208, num_hidden_layers=26, max_position_embeddings=131_072, query_pre_attn_scalar=256,
                   sliding_window=4096, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0),
    "gemma4": dict(_GEMMA_COMMON_DEFAULTS, vocab_size=262_144, num_hidden_layers=30, max_position_embeddings=131_072, sliding_window=512,
                   hidden_size_per_layer_input=256, global_head_dim=512, rope_parameters={
                       "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                       "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}),
}
# family -> (norm weight offset in HF files, default sliding_window_pattern, default sliding window, q/k norm, v norm
# and layer scalar, local rope base when the config names none)
_GEMMA_DEFAULTS = {
    "gemma2": (1.0, 2, 4096, False, False, None),
    "gemma3": (1.0, 6, 4096, True, False, 10_000.0),
    "gemma4": (0.0, 6, 512, True, True, 10_000.0),
}


def _hf_gemma_fields(config: dict[str, Any], family: str, max_position: int, max_context: int | None) -> dict[str, Any]:
    """The ModelConfig fields of a Gemma 2/3/4 text config: GeGLU, pre and post norms, the scaled embedding,
    the attention scale, q/k (and v) norms, interleaved sliding and full layers with their own rope, soft-capping.
    What jaxinfer does not run (Gemma 4's per-layer embeddings, shared KV, MoE, k = v,
    per-layer head sizes) is an error naming the field."""
    offset, pattern, default_window, qk_norm, gemma4, local_theta = _GEMMA_DEFAULTS[family]
    _check_gemma_unsupported(config, family)
    num_layers = int(config["num_hidden_layers"])
    layer_types = config.get("layer_types") or [
        "sliding_attention" if (i + 1) % int(config.get("sliding_window_pattern", pattern)) else "full_attention" for i in range(num_layers)
    ]
    if gemma4:
        layer_types = [*layer_types[:-1], "full_attention"]  # transformers forces Gemma 4's last layer to full attention
    rope = config.get("rope_parameters") or {}
    if "full_attention" in rope:  # transformers >= 5: one rope dict per layer type
        global_rope, local_rope = rope["full_attention"] or {}, rope.get("sliding_attention") or {}
    else:
        global_rope = {**(config.get("rope_scaling") or {}), **rope, "rope_theta": config.get("rope_theta") or rope.get("rope_theta") or 10_000.0}
        local_rope = {"rope_theta": config.get("rope_local_base_freq", local_theta)} if local_theta else {}
    if local_rope.get("rope_type", "default") != "default":
        raise ValueError(f"unsupported rope type {local_rope['rope_type']!r} for the sliding layers; jaxinfer runs them with plain rope")
    scale = config.get("query_pre_attn_scalar", 256)
    softcap, attn_cap = config.get("final_logit_softcapping"), config.get("attn_logit_softcapping")
    return dict(
        rope_theta=float(global_rope.get("rope_theta") or 1_000_000.0), layer_types=tuple(layer_types),
        rope_scaling=_gemma_global_rope(global_rope, max_position, int(config.get("head_dim") or 256)),
        local_rope_theta=float(local_rope["rope_theta"]) if local_rope.get("rope_theta") else None,
        sliding_window=int(config.get("sliding_window") or default_window), qk_norm=qk_norm, v_norm=gemma4, layer_scale=gemma4,
        hidden_act="gelu_tanh", post_norms=True, norm_weight_offset=offset, embed_scale=float(config["hidden_size"]) ** 0.5,
        query_scale=1.0 if gemma4 else float(scale) ** -0.5, final_logit_softcap=None if softcap is None else float(softcap),
        attn_logit_softcap=float(attn_cap) if attn_cap else None,
        tie_embeddings=bool(config.get("tie_word_embeddings", True)), max_context=max_context or max_position,
    )


def _gemma_global_rope(rope: dict[str, Any], max_position: int, head_dim: int) -> RopeScaling | None:
    """The full-attention layers' rope scaling. Gemma 4's "proportional" rope turns only the first
    partial_rotary_factor of the frequencies (base ** (-2i / head_dim), then / factor), the rest stay at 0:
    one divisor per frequency, infinite for the unrotated ones."""
    if rope.get("rope_type") != "proportional":
        return rope_scaling_from_hf(rope, max_position)
    rotated = int(float(rope.get("partial_rotary_factor", 1.0)) * head_dim // 2)
    factor = float(rope.get("factor", 1.0))
    return RopeScaling(kind="frequency_factors", frequency_factors=(factor,) * rotated + (math.inf,) * (head_dim // 2 - rotated))


def _check_gemma_unsupported(config: dict[str, Any], family: str) -> None:
    """Gemma features jaxinfer does not run, named."""
    act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"unsupported hidden_activation {act!r}; jaxinfer runs Gemma's GeGLU with gelu_pytorch_tanh")
    named = {"use_bidirectional_attention": "bidirectional attention",
             "hidden_size_per_layer_input": "per-layer input embeddings (Gemma 4 PLE)", "num_kv_shared_layers": "KV shared across layers",
             "enable_moe_block": "mixture-of-experts blocks", "attention_k_eq_v": "keys reused as values"}
    for key, what in named.items():
        if config.get(key):
            raise ValueError(f"unsupported {key}: {config[key]!r} ({what})")
    if family == "gemma4" and "per_layer_config" not in config and config.get("global_head_dim", 512) != config.get("head_dim", 256):
        raise ValueError(f"unsupported global_head_dim {config.get('global_head_dim', 512)} != head_dim {config.get('head_dim', 256)} "
                         "(full-attention layers with their own head size)")
    for index, layer in (config.get("per_layer_config") or {}).items():
        for key in ("head_dim", "num_key_value_heads"):
            if key in layer and layer[key] != config.get(key):
                raise ValueError(f"unsupported per_layer_config: layer {index} has {key} {layer[key]}, the others {config.get(key)}")


_PARTIAL_ROTARY = ("phi3",)  # families whose attention turns only partial_rotary_factor of each head (transformers' Phi3)
_ROPE_NEEDS = {  # keys each HF rope type must have
    "linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",), "longrope": ("short_factor", "long_factor"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


def _hf_rope_dict(config: dict[str, Any], rope: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The rope dict as transformers 5 standardizes it: a top-level `original_max_position_embeddings` wins (Phi-3's,
    4096 when absent), a top-level `partial_rotary_factor` fills in; Phi3Config reads "su" and "yarn" as longrope."""
    rope = dict(rope)
    if model_type == "phi3" and rope.get("rope_type", rope.get("type")) in ("su", "yarn"):
        rope["rope_type"] = "longrope"
    original = config.get("original_max_position_embeddings", 4096 if model_type == "phi3" else None)
    if original is not None and rope:
        rope["original_max_position_embeddings"] = original
    if "partial_rotary_factor" in config:
        rope.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    return rope


def _hf_long_context(kind: str, rope: dict[str, Any], max_position: int) -> RopeScaling:
    """yarn and longrope as transformers' `_compute_yarn_parameters` / `_compute_longrope_parameters`: factor
    (None: max_position / original); attention_factor as given, else yarn's 0.1 ln(factor) + 1 (a ratio of two
    with mscale and mscale_all_dim) or longrope's sqrt(1 + ln(factor) / ln(original)); yarn's beta_fast and
    beta_slow (falsy: 32 and 1) and truncate; longrope's short and long factors."""
    original = int(rope.get("original_max_position_embeddings") or max_position)
    factor = float(rope["factor"]) if rope.get("factor") is not None else max_position / original
    mscale = lambda m=1.0: 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0  # noqa: E731
    if kind == "longrope":
        default = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        extra = dict(short_factors=tuple(map(float, rope["short_factor"])), long_factors=tuple(map(float, rope["long_factor"])))
    else:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        default = mscale(m) / mscale(m_all) if m and m_all else mscale()
        extra = dict(beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1), truncate=bool(rope.get("truncate", True)))
    attention = rope.get("attention_factor")
    return RopeScaling(kind=kind, factor=factor, original_max_position=original, attention_factor=float(default if attention is None else attention), **extra)


def rope_scaling_from_hf(rope: dict[str, Any], max_position: int, *, field: str = "rope_parameters") -> RopeScaling | None:
    """HF `rope_parameters` (or the older `rope_scaling`, named by `field` in errors) -> RopeScaling; None for plain rotary."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in ("default", None):
        return None
    if kind not in HF_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {kind!r}; supported: default, {', '.join(HF_ROPE_TYPES)}")
    missing = [key for key in _ROPE_NEEDS[kind] if key not in rope]
    if missing:
        raise ValueError(f"{field} has no {missing[0]!r}, which rope_type {kind!r} needs")
    if kind in ("yarn", "longrope"):
        return _hf_long_context(kind, rope, max_position)
    factor = float(rope["factor"])
    if kind == "linear":
        return RopeScaling(kind=kind, factor=factor)
    if kind == "dynamic":  # transformers measures the growth against max_position_embeddings
        return RopeScaling(kind=kind, factor=factor, original_max_position=max_position)
    return RopeScaling(
        kind=kind,
        factor=factor,
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_position=int(rope["original_max_position_embeddings"]),
    )


def _hf_sliding_window(config: dict[str, Any]) -> int | None:
    """The window a config really applies: Mistral's `sliding_window`; Qwen's only with `use_sliding_window`."""
    if config.get("model_type") in ("qwen2", "qwen3") and not config.get("use_sliding_window", False):
        return None
    window = config.get("sliding_window")
    return None if window is None else int(window)


def _check_hf_unsupported(config: dict[str, Any]) -> None:
    """Features of these families that jaxinfer does not run, named instead of silently dropped."""
    gemma = _GEMMA_TEXT_TYPES.get(config.get("model_type"), config.get("model_type")) in _GEMMA_DEFAULTS  # GeGLU, checked there
    if not gemma and config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {config['hidden_act']!r}; jaxinfer runs SwiGLU (silu)")
    if config.get("mlp_bias"):
        raise ValueError("unsupported mlp_bias: true (biases on the MLP projections)")
    if config.get("attention_bias") and config.get("model_type") != "qwen2":
        raise ValueError("unsupported attention_bias: true (biases on q/k/v and the output projection)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Host-side knobs of the paged engine, as the user gave them: pool size, budgets, bucket tables.

    Every jitted program's shape comes from the bucket tables, and all of them are compiled at warm-up.
    Every field is checked here, where it is built; errors name the field (`FieldError`). Tables left at
    None stay None here; `BucketTables.from_config(cfg)` derives them from the limits (any valid set of
    limits derives tables that warm up), and the scheduler and the engine read the tables only there.
    """

    page_size: int = 64  # tokens per KV page
    num_pages: int | None = None  # pages in the pool incl. the null page; None: from kv_memory_fraction
    kv_memory_fraction: float = 0.2  # share of free device memory for the pool when num_pages is None
    max_num_seqs: int = 32  # running sequences at most (largest decode batch)
    max_prefill_tokens: int = 512  # prefill token budget per step (sum of chunk lengths)
    max_context: int = 2048  # tokens per sequence (prompt + generated) at most
    # Padded chunk lengths. None: bucket_tables.DEFAULT_CHUNK_BUCKETS, fitted to a conversation-like trace, plus a 32-token
    # bucket because chat prompts typed in notebooks (30-60 tokens) are rarer in that trace than in
    # interactive use; buckets over min(max_prefill_tokens, max_context) are dropped.
    prefill_chunk_buckets: tuple[int, ...] | None = None
    prefill_seq_buckets: tuple[int, ...] = (1,)  # rows of an unpacked prefill step (one sequence each)
    decode_batch_buckets: tuple[int, ...] | None = None  # sequences per decode step; None: 1, 4, 8, 16, 32 cut at max_num_seqs
    decode_page_buckets: tuple[int, ...] | None = None  # pages read per sequence; None: powers of two
    # A jaxinfer.bucketing.strategies.EngineBuckets (checked by duck type): a strategy for the chunk, rows and
    # pages tables left at None above.
    buckets: Any = None
    # Pack several sequences' prefill chunks into one row (segment-aware causal mask), so a step pads only
    # its end. None: packed, unless deterministic or prefill_seq_buckets asks for several unpacked rows.
    prefill_packing: bool | None = None
    max_prefill_seqs: int = 8  # sequences one packed prefill row holds at most (its logits rows)
    decode_split_overhead: float = 44.0  # fixed cost of a decode step in row-page units (SmolLM2 f32, 2-core CPU)
    attention_impl: str = "auto"  # auto | reference | pallas (GPU kernel) | cpu (CPU kernel); engine/backends.resolve_impl
    # auto | xla (XLA dot on the loaded params) | cpu (panels for kernels_cpu/layer_matmul) | int8 (quantization="int8"
    # weights times activations quantized in blocks, XLA's int8 dot: quant.with_int8_activations); backends.resolve_matmul_impl
    matmul_impl: str = "auto"
    # KV pool storage: None (the model's dtype), "int8" (a scale per token and kv head, taken at write) or
    # "fp8_e4m3" (float8_e4m3fn codes with a per-token scale). Scales live in the pool and count in its bytes.
    kv_cache_dtype: str | None = None
    compilation_cache_dir: str | None = "~/.cache/jaxinfer/xla"  # JAX persistent cache; None disables; this default means <cache root>/xla (engine.enable_compilation_cache)
    compile_threads: int = 2  # programs compiled in parallel at warm-up
    seed: int = 0  # base of the per-request seeds of requests that give none
    enable_prefix_caching: bool = True  # share full KV pages of equal prefixes between requests
    # Tokens every layer's queries see when the model is windowed throughout (Mistral): a running request's
    # pages wholly before its next query's window go back to the pool. Set by LLM from the model
    # (kv_manager.page_release_window); None: no page is released before its request ends.
    release_window: int | None = None
    # Bitwise-reproducible logits whatever else runs: fixed rows and chunk per phase (decode steps of more
    # rows run as several 8-row programs), blockwise attention, and preempted requests replay generated
    # tokens through decode steps.
    deterministic: bool = False
    max_logprobs: int = 20  # top log-probabilities a request may ask for (static: the programs return this many)
    max_logit_bias: int = 64  # logit_bias entries per request (min_tokens' bans on EOS and the stop ids are the token mask's)
    logprobs_mode: str = "raw"  # raw: from the model's logits; processed: after bias, penalties and temperature
    # The grammar's masks (structured output) are filled on the host while the device runs the step's forward
    # program, and read by its draw program; False fills them before the forward (the same programs and outputs).
    overlap_masks: bool = True
    # Scheduling policy (scheduling/policies.py), one of POLICIES: admission order, preemption victim, prefill
    # budget and decode width. "fcfs": priority, then deadline, then arrival; the others never change a token
    # in deterministic mode, only which step computes it.
    policy: str = "fcfs"
    latency_target_s: float = 0.25  # seconds: the p99 step latency the "adaptive" policy steers toward
    # "prefix" and "shortest-prompt" reorder a request only among the arrivals of its epoch (arrival index // this), so
    # none waits behind later epochs; None: one epoch, the most reordering (in a stream, a wait until the input ends)
    policy_epoch: int | None = None

    def __post_init__(self):
        self._check_limits()
        self._check_tables()

    def _check_limits(self) -> None:
        check_int("page_size", self.page_size, low=1)
        if self.num_pages is not None:
            check_int("num_pages", self.num_pages, low=2)  # page 0 is the null page
        check_number("kv_memory_fraction", self.kv_memory_fraction, low=0.0, high=1.0, low_open=True)
        for name in ("max_num_seqs", "max_prefill_tokens", "max_context", "compile_threads", "max_prefill_seqs", "max_logit_bias"):
            check_int(name, getattr(self, name), low=1)
        if self.max_context % self.page_size:
            raise FieldError("max_context", f"must be a multiple of page_size ({self.page_size}), got {self.max_context}")
        check_number("decode_split_overhead", self.decode_split_overhead, low=0.0, high=math.inf)
        if self.attention_impl not in ATTENTION_IMPLS:
            raise FieldError("attention_impl", f"must be one of {ATTENTION_IMPLS}, got {self.attention_impl!r}")
        if self.matmul_impl not in MATMUL_IMPLS:
            raise FieldError("matmul_impl", f"must be one of {MATMUL_IMPLS}, got {self.matmul_impl!r}")
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise FieldError("kv_cache_dtype", f"must be None or one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.compilation_cache_dir is not None and not isinstance(self.compilation_cache_dir, str):
            raise FieldError("compilation_cache_dir", f"must be a directory path or None, got {self.compilation_cache_dir!r}")
        check_int("seed", self.seed, low=0)
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        if self.release_window is not None:
            check_int("release_window", self.release_window, low=1)
        check_bool("overlap_masks", self.overlap_masks)
        check_bool("deterministic", self.deterministic)
        if self.policy not in POLICIES:
            raise FieldError("policy", f"must be one of {', '.join(POLICIES)}; got {self.policy!r}")
        check_number("latency_target_s", self.latency_target_s, low=0.0, high=math.inf, low_open=True)
        if self.policy_epoch is not None and check_int("policy_epoch", self.policy_epoch, low=1) and self.policy not in EPOCH_POLICIES:
            raise FieldError("policy_epoch", f"applies to the {' and '.join(EPOCH_POLICIES)} policies; policy {self.policy!r} orders no epochs")
        check_int("max_logprobs", self.max_logprobs, low=0)
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise FieldError("logprobs_mode", f"must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        if self.prefill_packing is not None:
            check_bool("prefill_packing", self.prefill_packing)
        if self.prefill_packing and self.deterministic:
            raise FieldError("prefill_packing", "cannot be combined with deterministic mode, whose prefill rows hold one sequence each")
        if self.buckets is not None and not _is_engine_buckets(self.buckets):
            raise FieldError("buckets", f"must be a jaxinfer.bucketing.strategies.EngineBuckets or None, got {self.buckets!r}")
        # Any attention_impl suits deterministic mode: 'pallas' runs the kernel's fixed-split config.

    def _check_tables(self) -> None:
        """The tables given, against the limits and each other; those left at None are derived later
        (BucketTables.from_config), and any valid set of limits derives tables that warm up."""
        given = sorted(name for name in TABLE_FIELDS if getattr(self, name) is not None)
        if self.deterministic:
            if given or self.prefill_seq_buckets not in ((1,), [1]):
                raise FieldError("deterministic", f"fixes the bucket tables itself; leave them unset (got {given or ['prefill_seq_buckets']})")
            if self.buckets is not None:
                raise FieldError("buckets", "deterministic mode fixes the bucket tables itself; leave buckets unset")
            pages = self.max_pages_per_seq
            if pages > DETERMINISTIC_PAGES_PER_BLOCK and pages % DETERMINISTIC_PAGES_PER_BLOCK:
                raise FieldError("deterministic", f"needs max_context / page_size ({pages} pages) to be a multiple of {DETERMINISTIC_PAGES_PER_BLOCK}")
        if self.buckets is not None:
            for dimension, name in zip(("chunk", "rows", "pages"), TABLE_FIELDS):
                if getattr(self.buckets, dimension) is not None and getattr(self, name) is not None:
                    raise FieldError("buckets", f"sets the {dimension} table, so leave {name} unset (got {getattr(self, name)!r})")
        for name in (*given, "prefill_seq_buckets"):
            object.__setattr__(self, name, check_table(name, getattr(self, name)))  # a list given becomes a tuple
        self._check_table_reach()

    def _check_table_reach(self) -> None:
        """Given tables reach the limits they serve (decode rows and pages) or stay within them (chunks)."""
        if self.decode_batch_buckets is not None and self.decode_batch_buckets[-1] < self.max_num_seqs:
            raise FieldError("decode_batch_buckets", f"must reach max_num_seqs ({self.max_num_seqs}); its largest is {self.decode_batch_buckets[-1]}")
        max_chunk = min(self.max_prefill_tokens, self.max_context)
        if self.prefill_chunk_buckets is not None and self.prefill_chunk_buckets[-1] > max_chunk:
            raise FieldError("prefill_chunk_buckets", f"must not exceed max_prefill_tokens ({self.max_prefill_tokens}) or max_context ({self.max_context}); its largest is {self.prefill_chunk_buckets[-1]}")
        if self.prefill_packing and self.prefill_seq_buckets != (1,):
            raise FieldError("prefill_seq_buckets", f"must be (1,) with prefill_packing, whose one row holds several sequences; got {self.prefill_seq_buckets}")
        if self.decode_page_buckets is not None and self.decode_page_buckets[-1] < self.max_pages_per_seq:
            raise FieldError("decode_page_buckets", f"must reach max_context / page_size ({self.max_pages_per_seq} pages); its largest is {self.decode_page_buckets[-1]}")

    @classmethod
    def with_overrides(cls, base: "EngineConfig | None" = None, **overrides) -> "EngineConfig":
        """`base` (or the defaults) with some fields replaced; an unknown name is an error with a hint.
        Tables the base left at None stay None, so they are derived again from the new limits."""
        names = {f.name for f in dataclasses.fields(cls)}
        for name in overrides:
            if name not in names:
                raise unknown_field_error(name, names)
        return cls(**overrides) if base is None else dataclasses.replace(base, **overrides)

    @property
    def max_pages_per_seq(self) -> int:
        return self.max_context // self.page_size


def check_table(name: str, table) -> tuple[int, ...]:
    """A bucket table: a non-empty increasing tuple of positive integers (FieldError naming `name`)."""
    if not isinstance(table, (tuple, list)) or not table or any(isinstance(b, bool) or not isinstance(b, int) for b in table) or list(table) != sorted(set(table)) or table[0] < 1:
        raise FieldError(name, f"must be a non-empty increasing tuple of positive integers, got {table!r}")
    return tuple(table)


def _is_engine_buckets(value) -> bool:
    """Duck type of jaxinfer.bucketing.strategies.EngineBuckets (the runtime never imports bucketing/):
    a strategy or None per dimension."""
    return all(hasattr(value, dimension) for dimension in ("chunk", "rows", "pages")) and hasattr(value, "describe")
