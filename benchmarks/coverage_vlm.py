"""Coverage over transformers' image-text-to-text models: one LoRA training step on images, eagerly and through sloth.

    python -m benchmarks.coverage_vlm                      # every model type, writes docs/coverage_vlm.md and a JSON
    python -m benchmarks.coverage_vlm gemma3 qwen2_vl      # some of them
    python -m benchmarks.coverage_vlm --one gemma3         # one, in this process (what each subprocess runs)

benchmarks/coverage.py's sweep (its subprocess runner, row format, table and step: eager in float64 and fp32
against ``torch.compile(backend="sloth", options={"inner": "aot_eager"})``, the whole-model tolerance rule) over
``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES``. Per model type:

- a tiny composite config (``tiny_vlm_config``): the text config shrunk as coverage.py shrinks it; every other
  sub-config (the vision tower's, a projector's or Q-Former's) to width 32, 2 heads, 2 layers, 32-pixel images of
  8-pixel patches; the config's layer indices onto the shrunk depths; special token ids into the vocabulary;
- random weights, fp32, eval mode; peft LoRA (r=4) on the language tower's projections (``add_lora``: the linear
  layers under ``get_decoder()`` and outside the vision tower, named in ``target_modules`` as a user would;
  B random so A has gradients), everything else frozen;
- inputs built without a processor from what the forward signature and the config ask for (``image_input_forms``):
  ``pixel_values`` in the shape the vision tower reads, with ``image_grid_thw``, ``pixel_attention_mask``,
  ``image_sizes``, ``spatial_shapes``, Mllama's aspect ratios and cross-attention mask, ``token_type_ids`` /
  ``mm_token_type_ids`` where the forward takes them; one image per row of two, its placeholder tokens (between
  the config's begin / end-of-image tokens, where it has them) as many as the model makes features
  (``placeholder_count``: get_image_features' count, checked by a forward, else the count the model's own check
  reports); labels are input_ids with the placeholders at -100;
- one forward and backward eagerly (float64 copy, fp32) and through sloth; the row is coverage.py's plus ``lora``
  (modules adapted) and ``image tokens`` (placeholders per image).

"inputs not built" is a model type whose inputs this file could not form (no vision tower it knows, or one that
rejects every input form tried): this builder's limit, counted apart from those that train.
"""
from __future__ import annotations

import dataclasses
import inspect
import re
import zlib
from typing import Any

from benchmarks import coverage
from benchmarks.coverage import REPO_ROOT, VOCAB, Sweep, set_field

ROWS = 2  # batch rows, one image each
TEXT_BEFORE, TEXT_AFTER = 3, 4  # text tokens around each row's image
SPECIAL = 32  # special token ids live in [VOCAB - SPECIAL, VOCAB); text ids below
IMAGE, PATCH = 32, 8  # pixels a side
VISION_LAYERS = 2
# Tower (vision, projector, Q-Former, audio) config fields shrunk wherever a config has them; a list of integers
# (Florence-2's per-stage widths) becomes that many of the value.
_TOWER_SHRINK = {
    "hidden_size": 32, "embed_dim": 32, "width": 32, "intermediate_size": 64, "mlp_dim": 64, "d_ff": 64,
    "num_attention_heads": 2, "num_heads": 2, "attention_heads": 2, "num_key_value_heads": 2, "num_groups": 2,
    "head_dim": 16, "d_kv": 16, "image_size": IMAGE, "patch_size": PATCH, "spatial_patch_size": PATCH,
    "num_position_embeddings": (IMAGE // PATCH) ** 2, "projection_dim": 32, "patch_embed_hidden_size": 32,
    "num_global_layers": 1, "max_num_tiles": 2, "output_channels": 32, "projection_hidden_dim": 64,
    "vocab_size": VOCAB, "num_query_tokens": 4, "encoder_hidden_size": 32, "cross_attention_frequency": 1,
    "projector_hidden_size": 64, "depths": 1, "resampler_n_latents": 4, "resampler_n_heads": 2,
    "resampler_head_dim": 16, "resampler_depth": 1,
}
_TO_TEXT_WIDTH = ("out_hidden_size", "text_hidden_size", "adapter_out_dim")  # what a tower projects into
_DEPTH = ("num_hidden_layers", "depth", "n_layers", "num_layers")
# Lists of layer indices, in any config: mapped onto the shrunk depth.
_INDEX_LISTS = ("fullatt_block_indexes", "deepstack_visual_indexes", "global_attn_indexes",
                "intermediate_layers_indices", "cross_attention_layers", "vision_feature_layers")
_TOP_SHRINK = {"mm_tokens_per_image": 4, "latent_query_num": 4, "num_query_tokens": 4, "projector_hidden_size": 64}
# Tokens around an image's placeholders, as (begin, end) config fields.
_BOUNDARIES = (("vision_start_token_id", "vision_end_token_id"), ("image_start_token_id", "image_end_token_id"),
               ("boi_token_id", "eoi_token_id"), ("boi_token_index", "eoi_token_index"))
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "out_proj", "gate_proj", "up_proj", "down_proj", "fc1", "fc2")


def vlm_model_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


# ----------------------------------------------------------------------------- the tiny config


def _sub_configs(cfg: Any) -> dict[str, Any]:
    """The config's nested configs by attribute name (vision_config, text_config, qformer_config, ...)."""
    from transformers import PretrainedConfig

    return {name: value for name, value in vars(cfg).items() if isinstance(value, PretrainedConfig)}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(_is_int(v) for v in value)


def _depth(cfg: Any) -> int | None:
    return next((getattr(cfg, n) for n in _DEPTH if _is_int(getattr(cfg, n, None))), None)


def _remap_indices(indices: list[int], old_depth: int, new_depth: int) -> list[int]:
    """Layer indices of an ``old_depth``-layer stack onto ``new_depth`` layers, in order, without repeats; negative
    ones (from the end) stay negative."""
    mapped = []
    for i in indices:
        j = i if i >= 0 else old_depth + i
        j = min(new_depth - 1, max(0, round((j + 1) * new_depth / max(old_depth, 1)) - 1))
        j = j if i >= 0 else j - new_depth
        if j not in mapped:
            mapped.append(j)
    return mapped


def _shrink_tower(sub: Any, text_width: int, old_text_width: int | None, vision: bool) -> None:
    """A tower's config shrunk in place (the module docstring); ``vision``: the vision tower's own."""
    depth = _depth(sub)
    # A field that equals the language model's width (PaliGemma's projection_dim; the hidden_size of a tower
    # between the vision tower and the text, Idefics2's perceiver), and a hidden_size beside an embed_dim (Qwen2-VL's
    # merger output), are what the tower projects into: they follow the text width. A vision tower's hidden_size
    # is its width, whatever the text's (LightOnOCR's 1024 both).
    follows_text = {field for field, value in vars(sub).items() if _is_int(value) and value == old_text_width
                    and (field != "hidden_size" or not vision) and ("hidden" in field or "dim" in field)}
    if _is_int(getattr(sub, "embed_dim", None)) and _is_int(getattr(sub, "hidden_size", None)):
        follows_text.add("hidden_size")
    follows_text.update(n for n in _TO_TEXT_WIDTH if _is_int(getattr(sub, n, None)))
    for field in follows_text:
        set_field(sub, field, text_width)
    for name, value in _TOWER_SHRINK.items():
        old = getattr(sub, name, None)
        if name in follows_text:
            continue
        if _is_int(old):
            set_field(sub, name, value)
        elif _int_list(old) and name in ("image_size", "patch_size") and len(old) == 2:
            set_field(sub, name, [value, value])
        elif _int_list(old) and name not in ("image_size", "patch_size"):
            set_field(sub, name, [value] * len(old))
    if depth is not None:
        for name in _DEPTH:
            if _is_int(getattr(sub, name, None)):
                set_field(sub, name, VISION_LAYERS)
        for name in _INDEX_LISTS:
            if _int_list(getattr(sub, name, None)):
                set_field(sub, name, _remap_indices(list(getattr(sub, name)), depth, VISION_LAYERS))
        layer_types = getattr(sub, "layer_types", None)
        if isinstance(layer_types, (list, tuple)) and len(layer_types) == depth:
            kinds = list(dict.fromkeys(layer_types))[:VISION_LAYERS]
            set_field(sub, "layer_types", (kinds * VISION_LAYERS)[:VISION_LAYERS])
    # Mllama's tower concatenates its intermediate layers' outputs to the last one's.
    taps = getattr(sub, "intermediate_layers_indices", None)
    if _is_int(getattr(sub, "vision_output_dim", None)) and _int_list(taps):
        set_field(sub, "vision_output_dim", sub.hidden_size * (len(taps) + 1))
    # Llama 4's pixel shuffle folds ratio^-2 patches into one: its MLP widths follow (the adapter's in and out equal).
    ratio = getattr(sub, "pixel_shuffle_ratio", None)
    if isinstance(ratio, float) and _is_int(getattr(sub, "projector_input_dim", None)):
        set_field(sub, "intermediate_size", int(sub.hidden_size / ratio**2))
        for name in ("projector_input_dim", "projector_output_dim", "vision_output_dim"):
            set_field(sub, name, sub.hidden_size)
    if isinstance(getattr(sub, "supported_aspect_ratios", None), list) and _is_int(getattr(sub, "max_num_tiles", None)):
        set_field(sub, "supported_aspect_ratios", [[1, 1], [1, 2], [2, 1]])


def _shrink_mrope(text: Any, grid_inputs: bool) -> None:
    """Multimodal RoPE's sections (rotary frequencies for time, height, width) scaled to the shrunk head's rotary
    half-width, in proportion, each at least 1. Where the config names none its modeling code has a default, which
    this cannot read: [1, 1, 2] in proportion then (Ernie-4.5-VL needs its first two equal, Qwen2-VL any), where the
    config class says it reads sections or the model takes (frames, height, width) grids."""
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    reads_sections = grid_inputs or "mrope_section" in getattr(type(text), "ignore_keys_at_rope_validation", ())
    for name in ("rope_parameters", "rope_scaling"):
        rope = getattr(text, name, None)
        if not isinstance(rope, dict):
            continue
        sections = rope.get("mrope_section") or ([1, 1, 2] if reads_sections else None)
        if not _int_list(sections):
            continue
        factor = rope.get("partial_rotary_factor", getattr(text, "partial_rotary_factor", None)) or 1.0
        half, total = int(head_dim * factor) // 2, sum(sections)
        scaled = [max(1, v * half // total) for v in sections]
        scaled[-1] += half - sum(scaled)
        rope["mrope_section"] = scaled


def _special_token_fields(cfg: Any) -> list[tuple[Any, str]]:
    """(config, field) of every special token id in the config and its text config, but pad / bos / eos."""
    targets = [cfg] + [c for n, c in _sub_configs(cfg).items() if n == "text_config"]
    return [(t, name) for t in targets for name, value in sorted(vars(t).items())
            if _is_int(value) and (name.endswith("_token_id") or name.endswith("_token_index"))
            and name not in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")]


@dataclasses.dataclass
class Widths:
    """The text and vision towers' hidden sizes in the default config and in the tiny one."""
    old_text: int | None
    text: int
    old_vision: int | None
    vision: int | None

    def follow(self, value: int) -> int | None:
        """What a width-derived field of default ``value`` becomes: the same multiple (1, 4, 9, 16: merged
        patches) of the text width, else of the vision width; None where it is neither."""
        for old, new in ((self.old_text, self.text), (self.old_vision, self.vision)):
            if old and _is_int(new) and value % old == 0 and value // old in (1, 4, 9, 16):
                return new * (value // old)
        return None


def tiny_vlm_config(model_type: str) -> Any:
    """coverage.tiny_config's text shrinking, every other sub-config shrunk as a tower (``_shrink_tower``), the
    fields tying them together made consistent again, special token ids into the vocabulary's top ``SPECIAL``."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    cfg = coverage.tiny_config(model_type)
    text = getattr(cfg, "text_config", None) or cfg
    widths = Widths(getattr(getattr(default, "text_config", None) or default, "hidden_size", None),
                    getattr(text, "hidden_size", None) or 64,
                    getattr(getattr(default, "vision_config", None), "hidden_size", None), None)
    for name, sub in _sub_configs(cfg).items():
        if sub is text or name in ("text_config", "decoder"):
            continue
        _shrink_tower(sub, widths.text, widths.old_text, vision=name == "vision_config")
        for inner in _sub_configs(sub).values():  # a tower inside a tower
            _shrink_tower(inner, widths.text, widths.old_text, vision=False)
    widths.vision = getattr(getattr(cfg, "vision_config", None), "hidden_size", None)
    _shrink_text(model_type, text, getattr(default, "text_config", None) or default, widths)
    _shrink_top(cfg, default, widths)
    _move_special_tokens(cfg)
    return cfg


def _shrink_text(model_type: str, text: Any, default_text: Any, widths: Widths) -> None:
    """What coverage.tiny_config leaves for a text tower inside a VLM: an encoder-decoder's layers (Florence-2's
    BART), layer indices (Mllama's cross-attention layers), M-RoPE's sections, widths it shares with the other
    towers (OPT's embedding width in BLIP-2, BLIP's cross-attention to the vision tower), a sliding window."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    for name in ("encoder_layers", "decoder_layers"):
        if _is_int(getattr(text, name, None)):
            set_field(text, name, 2)
    old_depth, depth = _depth(default_text), _depth(text)
    if old_depth and depth:
        for name in _INDEX_LISTS:
            if _int_list(getattr(text, name, None)):
                set_field(text, name, _remap_indices(list(getattr(text, name)), old_depth, depth))
    model_class = getattr(transformers, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(model_type, ""), None)
    _shrink_mrope(text, model_class is not None and "image_grid_thw" in _forward_parameters(model_class))
    for name, value in vars(default_text).items():
        if (_is_int(value) and name != "hidden_size" and ("hidden" in name or "dim" in name)
                and getattr(text, name, None) == value):  # a width tiny_config did not shrink
            # a cross-attention's encoder width is the vision tower's, even where the default text width is equal
            vision = value == widths.old_vision and _is_int(widths.vision)
            if vision and ("encoder" in name or value != widths.old_text):
                set_field(text, name, widths.vision)
            elif value == widths.old_text:
                set_field(text, name, widths.text)
    sliding = "sliding_attention" in (getattr(text, "layer_types", None) or ()) or any(
        "sliding" in n for n in vars(text) if n != "sliding_window")
    if getattr(text, "sliding_window", 0) is None and sliding:
        set_field(text, "sliding_window", 4)  # Step3p7: sliding layers, no window in the default config


def _shrink_top(cfg: Any, default: Any, widths: Widths) -> None:
    """The composite config's own fields: the tower layers a projector reads, token counts, widths derived from the
    towers' (MiniMax-M3-VL's merged_hidden_size = text width x merge^2, Kimi-K2.5's projector width), tilings, a
    projector's patch -> query table, a tower configured at the top level."""
    vision_depth = _depth(getattr(default, "vision_config", None))
    for name in ("vision_feature_layer", "vision_feature_layers"):
        value = getattr(cfg, name, None)
        if vision_depth and _int_list(value):
            set_field(cfg, name, _remap_indices(list(value), vision_depth + 1, VISION_LAYERS + 1))  # + the embeddings
        elif vision_depth and _is_int(value) and value >= 0:
            set_field(cfg, name, min(value, VISION_LAYERS))
    for name, value in _TOP_SHRINK.items():
        if _is_int(getattr(cfg, name, None)):
            set_field(cfg, name, value)
    for name, value in vars(default).items():
        if _is_int(value) and name not in _TOP_SHRINK and ("hidden" in name or "dim" in name):
            followed = widths.follow(value)
            if followed is not None:
                set_field(cfg, name, followed)
    if isinstance(getattr(cfg, "image_grid_pinpoints", None), list):  # LLaVA-NeXT's tilings of a larger image
        cfg.image_grid_pinpoints = [[IMAGE, IMAGE], [IMAGE, 2 * IMAGE], [2 * IMAGE, IMAGE], [2 * IMAGE, 2 * IMAGE]]
    for name, value in list(vars(cfg).items()):  # Aria: queries per image, by its patch count
        if name.endswith("patch_to_query_dict") and isinstance(value, dict):
            set_field(cfg, name, {(IMAGE // PATCH) ** 2: 4})
            if _is_int(getattr(cfg, f"max_value_{name}", None)):
                set_field(cfg, f"max_value_{name}", 4)
    if getattr(cfg, "vision_config", None) is None:  # Idefics, Fuyu
        for name, value in (("image_size", IMAGE), ("patch_size", PATCH)):
            if _is_int(getattr(cfg, name, None)):
                set_field(cfg, name, value)


def _move_special_tokens(cfg: Any) -> None:
    """Special token ids into [VOCAB - SPECIAL, VOCAB - 1) (VOCAB - 1: where tiny_config clamps bos / eos / pad), one
    per distinct original id; a placeholder token where the config's is None (BLIP-2 in transformers 5 needs one)."""
    if _placeholder_token(cfg) is None:
        target, name = next(((t, n) for t in (cfg, getattr(cfg, "text_config", None)) for n in _PLACEHOLDERS
                             if t is not None and n in vars(t)), (None, None))
        if target is not None:
            set_field(target, name, VOCAB - SPECIAL)
    ids: dict[int, int] = {}
    for target, name in _special_token_fields(cfg):
        ids.setdefault(getattr(target, name), VOCAB - 2 - len(ids))
        set_field(target, name, ids[getattr(target, name)])


# ----------------------------------------------------------------------------- inputs


def _token(cfg: Any, *names: str) -> int | None:
    for name in names:
        for target in (cfg, getattr(cfg, "text_config", None)):
            if _is_int(getattr(target, name, None)):
                return getattr(target, name)
    return None


_PLACEHOLDERS = ("image_token_id", "image_token_index", "video_token_id", "video_token_index")


def _placeholder_token(cfg: Any) -> int | None:
    """The token an image's features replace (a video's, for a model of videos only: InstructBLIP-Video)."""
    return _token(cfg, *_PLACEHOLDERS)


def _forward_parameters(module: Any) -> set[str]:
    """The forward's parameter names, of a module or a model class."""
    return set(inspect.signature(module.forward).parameters)


def _tower(model: Any, cfg: Any) -> Any:
    vision = getattr(cfg, "vision_config", None)
    return next((m for m in model.modules() if vision is not None and getattr(m, "config", None) is vision), None)


def image_input_forms(model: Any, cfg: Any) -> list[dict[str, Any]]:
    """The vision inputs of one image per row, in each form the forward signature and the vision config allow,
    the likeliest first; keyed by those, not by model type, so a new model with a known kind of tower needs
    nothing here."""
    import torch

    params = _forward_parameters(model)
    vision = getattr(cfg, "vision_config", None)
    if vision is None:
        raise ValueError("no vision_config (a VQ image tokenizer, an encoder-decoder or a tower configured otherwise)")
    if "pixel_values" not in params:
        raise ValueError("the forward takes no pixel_values")
    generator = torch.Generator().manual_seed(2)
    channels = next((getattr(vision, n) for n in ("num_channels", "in_channels")
                     if _is_int(getattr(vision, n, None))), 3)
    patch, size = getattr(vision, "patch_size", PATCH), getattr(vision, "image_size", IMAGE)
    patch = patch[0] if isinstance(patch, (list, tuple)) else patch
    size = size[0] if isinstance(size, (list, tuple)) else size
    if not _is_int(patch) or not _is_int(size):
        raise ValueError(f"vision patch_size {patch!r} / image_size {size!r} are not integers")
    # patches a token merges, a side: Qwen2-VL's spatial_merge_size, Kimi-K2.5's merge_kernel_size [2, 2]
    merge = next((getattr(vision, n) for n in ("spatial_merge_size", "merge_size")
                  if _is_int(getattr(vision, n, None))), None) or (getattr(vision, "merge_kernel_size", None) or [1])[0]

    def randn(*shape: int) -> Any:
        return torch.randn(*shape, generator=generator)

    extra: dict[str, Any] = {}
    if "qformer_input_ids" in params:  # InstructBLIP: the instruction again, for its Q-Former
        extra["qformer_input_ids"] = torch.randint(3, VOCAB - SPECIAL, (ROWS, TEXT_BEFORE), generator=generator)
        extra["qformer_attention_mask"] = torch.ones(ROWS, TEXT_BEFORE, dtype=torch.long)
    if "high_res_pixel_values" in params:  # DeepSeek-VL-Hybrid's second (SAM) tower
        high = getattr(cfg, "high_res_vision_config", vision)
        extra["high_res_pixel_values"] = randn(ROWS, channels, high.image_size, high.image_size)
    if "image_grid_thw" in params:
        # Qwen2-VL's form: every image's patches flattened, rows of (channels x frames x patch x patch) values, and
        # each image's (frames, height, width) in patches; the merger joins merge x merge patches into one token.
        # Kimi-K2.5 reads the rows as [C, patch, patch] images, PaddleOCR-VL as one batch of those.
        temporal = next((getattr(vision, n) for n in ("temporal_patch_size", "patch_temporal")
                         if _is_int(getattr(vision, n, None))), 1)
        side, patches = 2 * merge, ROWS * 4 * merge * merge
        extra["image_grid_thw"] = torch.tensor([[1, side, side]] * ROWS)
        if "image_merge_sizes" in params:  # VideoLLaMA3: the merge size per image
            extra["image_merge_sizes"] = torch.tensor([merge] * ROWS)
        flat = randn(patches, channels * temporal * patch * patch)
        return [{"pixel_values": flat, **extra},
                {"pixel_values": flat.view(patches, channels * temporal, patch, patch), **extra},
                {"pixel_values": flat.view(1, patches, channels * temporal, patch, patch), **extra}]
    if "aspect_ratio_ids" in params:
        # Mllama: [batch, images, tiles, C, H, W]; the 1 x 1 tiling (aspect-ratio id 1), its first tile real;
        # every text token attends to it (the mask's text length is filled in by build_inputs).
        mask = torch.zeros(ROWS, 1, vision.max_num_tiles, dtype=torch.long)
        mask[:, :, 0] = 1
        return [{"pixel_values": randn(ROWS, 1, vision.max_num_tiles, channels, size, size),
                 "aspect_ratio_ids": torch.ones(ROWS, 1, dtype=torch.long), "aspect_ratio_mask": mask,
                 "cross_attention_mask": None, **extra}]
    if "spatial_shapes" in params:
        # SigLIP-2 (LFM2-VL): patches flattened per image, [images, patches, C x patch x patch], their grid, a mask.
        side = size // patch
        return [{"pixel_values": randn(ROWS, side * side, channels * patch * patch),
                 "spatial_shapes": torch.tensor([[side, side]] * ROWS),
                 "pixel_attention_mask": torch.ones(ROWS, side * side, dtype=torch.bool), **extra}]
    if "pixel_attention_mask" in params:
        # Idefics2/3, SmolVLM: [batch, images, C, H, W] and which pixels are real; Granite-Docling: which tiles.
        pixels = randn(ROWS, 1, channels, size, size)
        return [{"pixel_values": pixels, "pixel_attention_mask": torch.ones(ROWS, 1, size, size, dtype=torch.bool),
                 **extra},
                {"pixel_values": pixels, "pixel_attention_mask": torch.ones(ROWS, 1, dtype=torch.bool), **extra}]
    if "image_sizes" in params and getattr(cfg, "image_grid_pinpoints", None):
        # LLaVA-NeXT: each image as its base view and the tiles of its best tiling ([batch, views, C, H, W]); an
        # image of the base size takes the 1 x 1 tiling: two views.
        return [{"pixel_values": randn(ROWS, 2, channels, size, size),
                 "image_sizes": torch.tensor([[size, size]] * ROWS), **extra}]
    if "target_sizes" in params:
        # MiniCPM-V: every image's patches side by side in one [1, C, patch, patches x patch] strip, and each
        # image's grid in patches
        side = size // patch
        strip = randn(1, channels, patch, ROWS * side * side * patch)
        return [{"pixel_values": strip, "target_sizes": torch.tensor([[side, side]] * ROWS), **extra}]
    plain = {"pixel_values": randn(ROWS, channels, size, size), **extra}
    tower = _tower(model, cfg)
    if tower is not None and "image_sizes" in _forward_parameters(tower):
        plain["image_sizes"] = torch.tensor([[size, size]] * ROWS)  # Pixtral's tower reads each image's size
    # and as [batch, frames, C, H, W] (InstructBLIP-Video)
    return [plain, {**plain, "pixel_values": plain["pixel_values"][:, None]}]


def build_inputs(model: Any, cfg: Any, vision_inputs: dict[str, Any], per_image: int) -> dict[str, Any]:
    """``vision_inputs`` and the text around them: per row, text, [begin-of-image], ``per_image`` placeholders,
    [end-of-image], text; labels with the placeholders at -100; the token-type inputs the forward takes."""
    import torch

    params = _forward_parameters(model)
    image = _placeholder_token(cfg)
    if image is None:  # Kosmos-2 marks its image's positions with a mask, not a token id
        image = VOCAB - SPECIAL
    begin, end = next(((_token(cfg, b), _token(cfg, e)) for b, e in _BOUNDARIES
                       if _token(cfg, b) is not None and _token(cfg, e) is not None), (None, None))
    generator = torch.Generator().manual_seed(1)
    text = torch.randint(3, VOCAB - SPECIAL, (ROWS, TEXT_BEFORE + TEXT_AFTER), generator=generator)
    pieces = [text[:, :TEXT_BEFORE]] + ([torch.full((ROWS, 1), begin)] if begin is not None else [])
    pieces += [torch.full((ROWS, per_image), image)] + ([torch.full((ROWS, 1), end)] if end is not None else [])
    ids = torch.cat(pieces + [text[:, TEXT_BEFORE:]], dim=1)
    is_image = ids == image
    inputs = dict(vision_inputs)
    inputs.update(input_ids=ids, labels=ids.masked_fill(is_image, -100))
    if "token_type_ids" in params:  # Gemma 3, PaliGemma: image tokens 1 (bidirectional among themselves)
        inputs["token_type_ids"] = is_image.long()
    if "mm_token_type_ids" in params:  # text 0, image 1, video 2 (Qwen2-VL's M-RoPE groups by them)
        inputs["mm_token_type_ids"] = is_image.int()
    if "image_embeds_position_mask" in params:
        inputs["image_embeds_position_mask"] = is_image.long()
    if "image_attention_mask" in params:  # IDEFICS: which images each token cross-attends to, [batch, text, images]
        inputs["image_attention_mask"] = torch.ones(ROWS, ids.shape[1], 1, dtype=torch.long)
    if "cross_attention_mask" in inputs:  # Mllama: [batch, text, images, tiles]
        inputs["cross_attention_mask"] = inputs["aspect_ratio_mask"][:, None].expand(-1, ids.shape[1], -1, -1).clone()
    return inputs


_MISMATCH = re.compile(r"tokens:\s*(\d+),\s*features:?\s*(\d+)")


def _feature_count(model: Any, vision_inputs: dict[str, Any]) -> int | None:
    """Image features per image from the model's get_image_features (the rows of its output, over ROWS images), or
    None where it has none or it fails: some models scatter features without counting the placeholders."""
    import torch

    get = getattr(model, "get_image_features", None)
    if get is None:
        return None
    params = inspect.signature(get).parameters
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    try:
        with torch.no_grad():
            out = get(**{k: v for k, v in vision_inputs.items() if k in params or takes_all})
    except Exception:
        return None
    features = getattr(out, "pooler_output", out)
    features = [features] if isinstance(features, torch.Tensor) else features
    if not isinstance(features, (list, tuple)) or not all(isinstance(f, torch.Tensor) for f in features):
        return None
    total = sum(f.shape[:-1].numel() for f in features)
    return total // ROWS if total % ROWS == 0 else None


def placeholder_count(model: Any, cfg: Any, vision_inputs: dict[str, Any]) -> int:
    """Placeholder tokens per image, as the model computes them: a forward with as many as get_image_features makes
    (or the config's count of queries, or one), and where the model's own check says the features are another
    number, that (its message counts all images; a few models count the features' elements, the count times the
    text width, tried next). Without a placeholder token in the config: none (the model puts the features in
    itself: GIT, BLIP), or the config's latent_query_num where a mask says where (Kosmos-2)."""
    import torch

    if _placeholder_token(cfg) is None:
        candidates = [getattr(cfg, "latent_query_num", 0) or 0]
    else:  # the features get_image_features makes, the config's count (BLIP-2's queries), or 1
        candidates = [n for n in (_feature_count(model, vision_inputs), getattr(cfg, "num_query_tokens", None))
                      if _is_int(n) and n > 1] + [1]
    text = getattr(cfg, "text_config", None) or cfg
    tried, first_error = [], None
    while candidates:
        per_image = candidates.pop(0)
        tried.append(per_image)
        inputs = build_inputs(model, cfg, vision_inputs, per_image)
        inputs.pop("labels")
        try:
            with torch.no_grad():
                model(**inputs)
            return per_image
        except Exception as error:  # the check raises ValueError, or torch._check's RuntimeError under it
            first_error = first_error or error
            found = _MISMATCH.search(str(error))
            if candidates:
                continue
            if found is None:
                raise first_error
            features, width = int(found.group(2)), getattr(text, "hidden_size", 0) or 0
            candidates = [n // ROWS for n in (features, features // width if width else 0)
                          if n and n % ROWS == 0 and n // ROWS not in tried]
            if not candidates:
                raise ValueError(f"no placeholder count fits: {str(error).splitlines()[0][:200]} (tried {tried})") \
                    from error
    raise AssertionError("unreachable")


def probe_inputs(model: Any, cfg: Any) -> tuple[dict[str, Any], int]:
    """The first input form (``image_input_forms``) the model takes, with its placeholder count; the first form's
    error where none fits."""
    errors = []
    forms = image_input_forms(model, cfg)
    for vision_inputs in forms:
        try:
            per_image = placeholder_count(model, cfg, vision_inputs)
            return build_inputs(model, cfg, vision_inputs, per_image), per_image
        except Exception as error:
            errors.append(error)
    if len(errors) == 1:
        raise errors[0]
    raise ValueError("; ".join(f"pixel_values {list(form['pixel_values'].shape)}: {type(e).__name__}: "
                               f"{str(e).splitlines()[0][:120] if str(e) else ''}"
                               for form, e in zip(forms, errors))) from errors[0]


# ----------------------------------------------------------------------------- LoRA and the row


def add_lora(model: Any, cfg: Any) -> Any:
    """peft LoRA (r=4, alpha 8, no dropout) on the language tower's projections, ``LORA_TARGETS`` (its every linear
    layer where it names none of them), B random (peft starts it at zero, which would leave every A gradient zero),
    as tests/test_models.py's build_lora; the rest frozen. The language tower: ``get_decoder()`` without the vision
    tower (and other towers configured apart from the text)."""
    import torch
    from peft import LoraConfig, get_peft_model

    decoder = model.get_decoder()
    prefix = next(name for name, module in model.named_modules() if module is decoder)
    towers = [id(m) for sub in _sub_configs(cfg).values() if sub is not getattr(cfg, "text_config", None)
              for m in model.modules() if getattr(m, "config", None) is sub and m is not decoder]
    apart = {name for name, module in decoder.named_modules() if id(module) in towers}
    head = model.get_output_embeddings()
    linears = [name for name, module in decoder.named_modules() if isinstance(module, torch.nn.Linear)
               and not any(name == t or name.startswith(t + ".") for t in apart) and module is not head]
    chosen = [n for n in linears if n.rsplit(".", 1)[-1] in LORA_TARGETS] or linears
    if not chosen:
        raise ValueError(f"no linear layers in the language tower {prefix or type(model).__name__}")
    targets = [f"{prefix}.{name}" if prefix else name for name in chosen]
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
    return model


def run_one(model_type: str) -> dict[str, Any]:
    """One model type's row (the module docstring); never raises: errors go into the row."""
    import torch
    from transformers import AutoModelForImageTextToText

    coverage.setup()
    try:
        torch.manual_seed(0)
        cfg = tiny_vlm_config(model_type)
        model = coverage.from_config(AutoModelForImageTextToText, cfg)
    except Exception as error:
        return coverage.error_row(model_type, "build error", error)
    try:
        inputs, per_image = probe_inputs(model, cfg)
    except Exception as error:
        return coverage.error_row(model_type, "inputs not built", error)
    try:
        model = add_lora(model, cfg)
    except Exception as error:  # this file's limit too: counted with the inputs it could not build
        row = coverage.error_row(model_type, "inputs not built", error)
        row["error"] = "LoRA: " + row["error"]
        return row
    row = coverage.step_row(model_type, model, inputs)
    row["lora"] = sum(1 for m in model.modules() if hasattr(m, "lora_A") and "default" in m.lora_A)
    row["image tokens"] = per_image
    return row


VLM = Sweep("benchmarks.coverage_vlm", vlm_model_types, run_one, REPO_ROOT / "docs" / "coverage_vlm.md",
            "# sloth over transformers' image-text-to-text models",
            "one fp32 LoRA training step of a tiny random model per type, one random image per row",
            "image-text-to-text model types", coverage.FAMILY_COLUMNS + ("lora",),
            "lora: peft adapters on the language tower's projections, replaced / left. \"inputs not built\": the "
            "inputs benchmarks/coverage_vlm.py forms without a processor do not fit the model (its limit; not "
            "counted among those that train). Most graph breaks are transformers': the image-placeholder count "
            "check (a Tensor.item() under peft's forward) and M-RoPE's data-dependent position ids.",
            lora_column=False, statuses=True)


if __name__ == "__main__":
    coverage.main(VLM)
