"""The data contract, the synthetic dataset, and the tiny Qwen2.5-VL model directory."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from common.detection.answer import (CHAT_SPECIAL_TOKENS, IM_END, IMAGE_PAD, SYSTEM_PROMPT, USER_PROMPT, build_messages,
                                     canonical_order, serialize_objects)
from common.data.records import (COORD_TOKENS, GTObject, RecordError, check_desc, coord_token, dequantize, iter_jsonl,
                                 load_record, parse_coord_token, quantize)
from common.data.synthetic import MANIFEST, generate, render_record
from common.detection.coord_tokens import CoordTokenError, contiguous_range, coord_token_ids, require_coord_tokens

HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None


# ---------------------------------------------------------------- quantisation and serialisation


def test_quantize_clamps_and_every_bin_round_trips_through_dequantize():
    assert [quantize(c) for c in (-0.5, 0.0, 1.0, 1.5)] == [0, 0, 999, 999]
    assert quantize(0.25) == 250  # round(249.75); bins are k/999, never k/1000
    assert all(quantize(dequantize(k)) == k for k in range(1000))
    assert dequantize(999) == 1.0


def test_coord_tokens_are_the_1000_bins_in_order_and_parse_back():
    assert len(COORD_TOKENS) == 1000 and COORD_TOKENS[110] == coord_token(110) == "<|coord_110|>"
    assert [parse_coord_token(t) for t in COORD_TOKENS] == list(range(1000))
    for bad in ("<|coord_1000|>", "<|coord_012|>", "<|coord_-1|>", "coord_5", 5):
        assert parse_coord_token(bad) is None


def test_serialize_gives_keys_object_1_to_k_in_the_given_order():
    objs = [GTObject("black cat", (110, 310, 410, 705)), GTObject("dog", (0, 0, 999, 999)),
            GTObject("a b", (1, 2, 3, 4))]
    text = serialize_objects(objs)
    assert text.startswith(
        '{"object_1": {"desc": "black cat", '
        '"bbox_2d": ["<|coord_110|>", "<|coord_310|>", "<|coord_410|>", "<|coord_705|>"]}, '
    )
    assert "\n" not in text
    decoded = json.loads(text)
    assert list(decoded) == ["object_1", "object_2", "object_3"]
    assert [v["desc"] for v in decoded.values()] == ["black cat", "dog", "a b"]
    assert decoded["object_2"]["bbox_2d"] == [coord_token(k) for k in (0, 0, 999, 999)]
    assert serialize_objects([]) == "{}"


def test_canonical_order_is_top_to_bottom_then_left_to_right_and_stable():
    a, b, c, d = (GTObject(n, bins) for n, bins in [("a", (500, 10, 600, 20)), ("b", (100, 10, 200, 20)),
                                                     ("c", (0, 5, 9, 9)), ("d", (100, 10, 300, 90))])
    assert [o.desc for o in canonical_order([a, b, c, d])] == ["c", "b", "d", "a"]


# ---------------------------------------------------------------- records


def _record(**over):
    rec = {"id": "r1", "images": ["img/1.png"], "width": 200, "height": 100, "coord_mode": "pixel",
           "objects": [{"desc": "red circle", "bbox_2d": [50, 25, 100, 50]}]}
    rec.update(over)
    return {k: v for k, v in rec.items() if v is not None}  # coord_mode=None: a record without one


def test_load_record_converts_pixels_with_width_and_height_to_bins():
    rec = load_record(_record())
    assert rec.id == "r1" and rec.images == ("img/1.png",) and (rec.width, rec.height) == (200, 100)
    assert rec.objects == (GTObject("red circle", (250, 250, 500, 500)),)
    full = load_record(_record(objects=[{"desc": "all", "bbox_2d": [0, 0, 200.0, 100]}]))
    assert full.objects[0].bins == (0, 0, 999, 999)
    assert rec.image_paths("/data") == ["/data/img/1.png"]


def test_load_record_takes_norm1000_bins_as_ints_or_coord_strings():
    objs = [{"desc": "x", "bbox_2d": [1, 2, 998, 999]}, {"desc": "y", "bbox_2d": ["<|coord_3|>", 4, "<|coord_5|>", 6]}]
    rec = load_record(_record(coord_mode="norm1000", objects=objs))
    assert [o.bins for o in rec.objects] == [(1, 2, 998, 999), (3, 4, 5, 6)]
    # The config (data.coord_mode) can declare norm1000 for a whole data set of records without their own.
    assert load_record(_record(coord_mode=None, objects=objs), coord_mode="norm1000").objects == rec.objects
    assert load_record(_record(objects=[])).objects == ()


@pytest.mark.parametrize(
    "over, field, fix_words",
    [
        ({"images": []}, "images", "images"),
        ({"width": 0}, "width", "pixels"),
        ({"height": "84"}, "height", "pixels"),
        ({"coord_mode": "relative"}, "coord_mode", "pick one"),
        ({"objects": {}}, "objects", '"objects": []'),
        ({"objects": [{"bbox_2d": [0, 0, 1, 1]}]}, "objects[0].desc", "single spaces"),
        ({"objects": [{"desc": "red circle"}]}, "objects[0].bbox_2d", "[x1, y1, x2, y2]"),
        ({"objects": [{"desc": "a", "bbox_2d": [0, 0, 201, 10]}]}, "objects[0].bbox_2d", "coord_mode"),
        ({"objects": [{"desc": "a", "bbox_2d": [30, 0, 20, 10]}]}, "objects[0].bbox_2d", "0 <= x1 <= x2"),
        ({"objects": [{"desc": "a", "bbox_2d": [0, 0, 1]}]}, "objects[0].bbox_2d", "four values"),
        ({"objects": [{"desc": "a", "bbox_2d": ["<|coord_1|>"] * 4}]}, "objects[0].bbox_2d",
         '"coord_mode": "norm1000"'),
        ({"coord_mode": "norm1000", "objects": [{"desc": "a", "bbox_2d": [0, 0, 1000, 5]}]}, "objects[0].bbox_2d",
         "bins"),
        ({"coord_mode": "norm1000", "objects": [{"desc": "a", "bbox_2d": [9, 0, 1, 5]}]}, "objects[0].bbox_2d",
         "order"),
        ({"objects": [{"desc": "a", "poly": [0, 0, 1, 1, 2, 2]}]}, "objects[0].poly", "bbox_2d"),
        ({"objects": [{"desc": "a", "bbox_2d": [0, 0, 1, 1]}, {"desc": "b, c", "bbox_2d": [0, 0, 1, 1]}]},
         "objects[1].desc", "single spaces"),
    ],
)
def test_load_record_errors_name_the_field_and_the_fix(over, field, fix_words):
    with pytest.raises(RecordError) as info:
        load_record(_record(**over), where="train.jsonl:7")
    err = info.value
    assert err.field == field
    assert str(err).startswith(f"train.jsonl:7 (id r1): {field}: ")
    assert "fix: " in str(err) and fix_words in err.fix


@pytest.mark.parametrize(
    "desc", ["", " cat", "cat ", "black  cat", "a, b", "a: b", "tab\there", "new\nline", "nbsp\u00a0x", "zw\u200bsp", 3]
)
def test_descriptions_that_would_break_the_single_line_json_are_rejected(desc):
    with pytest.raises(RecordError):
        check_desc(desc)


def test_descriptions_with_ordinary_punctuation_and_unicode_are_kept():
    for desc in ["black cat", "cat,dog", "3:4 ratio", 'the "big" one', "café au lait", "x/y"]:
        assert check_desc(desc) == desc


def test_a_broken_jsonl_line_is_reported_with_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(_record()) + "\n\n{not json\n")
    with pytest.raises(RecordError, match=r"bad\.jsonl:3: <line>: invalid JSON"):
        list(iter_jsonl(path))


def test_build_messages_puts_the_system_prompt_then_images_then_the_user_prompt():
    rec = load_record(_record(images=["a.png", "b.png"]))
    msgs = build_messages(rec, ["/x/a.png", "/x/b.png"])
    assert [m["role"] for m in msgs] == ["system", "user"]
    assert msgs[0]["content"] == [{"type": "text", "text": SYSTEM_PROMPT}]
    assert msgs[1]["content"] == [
        {"type": "image", "image": "/x/a.png"},
        {"type": "image", "image": "/x/b.png"},
        {"type": "text", "text": USER_PROMPT},
    ]
    with_answer = build_messages(rec, ["/x/a.png", "/x/b.png"], assistant="{}")
    assert with_answer[-1] == {"role": "assistant", "content": [{"type": "text", "text": "{}"}]}
    with pytest.raises(ValueError, match="2 images but 1 paths"):
        build_messages(rec, ["/x/a.png"])


# ---------------------------------------------------------------- synthetic data


def test_synthetic_generator_is_byte_identical_for_the_same_seed(tmp_path):
    a = generate(tmp_path / "a", n=10, seed=3).parent
    b = generate(tmp_path / "b", n=10, seed=3).parent
    c = generate(tmp_path / "c", n=10, seed=4).parent
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert len(files) == 10 + 3  # images, train.jsonl, val.jsonl, manifest.json
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    assert (a / "train.jsonl").read_bytes() != (c / "train.jsonl").read_bytes()
    # Record i does not depend on n: the first records of a bigger set are the same.
    big = generate(tmp_path / "big", n=20, seed=3, split=(20, 0)).parent
    assert (big / "train.jsonl").read_text().splitlines()[:9] == (a / "train.jsonl").read_text().splitlines()


def test_synthetic_records_have_1_to_12_objects_inside_the_image_and_pass_load_record(synth_data_dir):
    from PIL import Image

    counts = []
    for split in ("train", "val"):
        lines = (synth_data_dir / f"{split}.jsonl").read_text().splitlines()
        assert len(lines) == {"train": 56, "val": 8}[split]
        for line in lines:
            raw = json.loads(line)
            rec = load_record(raw)
            w, h = raw["width"], raw["height"]
            assert w in (56, 84, 112) and h in (56, 84, 112)
            with Image.open(synth_data_dir / raw["images"][0]) as im:
                assert im.size == (w, h) and im.mode == "RGB"
            assert 1 <= len(rec.objects) <= 12
            counts.append(len(rec.objects))
            for obj in raw["objects"]:
                x1, y1, x2, y2 = obj["bbox_2d"]
                assert 0 <= x1 < x2 <= w and 0 <= y1 < y2 <= h
                words = obj["desc"].split(" ")
                assert words[-1] in ("rectangle", "square", "ellipse", "circle", "triangle")
    assert min(counts) <= 2 and max(counts) >= 11  # the whole range is exercised


def test_a_synthetic_box_is_the_tight_box_of_the_drawn_shape():
    import numpy as np

    image, record = render_record(seed=0, index=5)
    pixels = np.asarray(image)
    top = record["objects"][-1]  # drawn last, so nothing covers it
    x1, y1, x2, y2 = top["bbox_2d"]
    inside = pixels[y1:y2, x1:x2].reshape(-1, 3)
    color = inside[len(inside) // 2]  # the box centre lies on the shape for all three shape kinds
    for edge in (pixels[y1, x1:x2], pixels[y2 - 1, x1:x2], pixels[y1:y2, x1], pixels[y1:y2, x2 - 1]):
        assert (edge == color).all(-1).any(), "each side of the box touches the shape"


def test_synthetic_generation_is_skipped_when_up_to_date_and_redone_when_parameters_change(tmp_path):
    out = tmp_path / "d"
    generate(out, n=4, seed=0)
    stamp = (out / MANIFEST).stat().st_mtime_ns
    generate(out, n=4, seed=0)
    assert (out / MANIFEST).stat().st_mtime_ns == stamp
    generate(out, n=6, seed=0)
    params = json.loads((out / MANIFEST).read_text())["params"]
    assert (params["n_train"], params["n_val"]) == (5, 1)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not written by common.data.synthetic"):
        generate(foreign, n=2)


def test_synthetic_cli_writes_the_requested_split(tmp_path, capsys):
    from common.data.synthetic import main

    assert main(["--out", str(tmp_path / "s"), "--split", "5/2", "--seed", "1"]) == 0
    assert len((tmp_path / "s" / "train.jsonl").read_text().splitlines()) == 5
    assert len((tmp_path / "s" / "val.jsonl").read_text().splitlines()) == 2
    assert "train 5, val 2" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "s"), "--split", "five"])


# ---------------------------------------------------------------- the tiny model


def _expand_image_pads(text: str, grids, merge_size: int) -> str:
    """What Qwen2-VL processors do: one <|image_pad|> per merged patch of each image, in order."""
    parts = text.split(IMAGE_PAD)
    assert len(parts) == len(grids) + 1
    return parts[0] + "".join(IMAGE_PAD * (int(g.prod()) // merge_size**2) + p for g, p in zip(grids, parts[1:]))


def _encode_prompt(record, image_root: Path, tokenizer, image_processor):
    """Prompt inputs built from the tokenizer's chat template and the image processor only."""
    import torch
    from PIL import Image

    paths = record.image_paths(image_root)
    text = tokenizer.apply_chat_template(build_messages(record, paths), tokenize=False, add_generation_prompt=True)
    images = [Image.open(p).convert("RGB") for p in paths]
    vision = image_processor(images=images, return_tensors="pt")
    ids = tokenizer(_expand_image_pads(text, vision["image_grid_thw"], image_processor.merge_size),
                    return_tensors="pt", add_special_tokens=False)
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    # transformers 5.x computes the 3-D mRoPE positions only when mm_token_type_ids is given (1 = image).
    mm = (ids["input_ids"] == image_id).to(torch.int32)
    return {**ids, "mm_token_type_ids": mm, **vision}


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir), AutoImageProcessor.from_pretrained(tiny_model_dir)


def test_tiny_model_is_a_qwen2_5_vl_whose_embeddings_cover_the_tokenizer(loaded):
    model, tok, improc = loaded
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert type(tok).__name__ == "Qwen2Tokenizer"
    assert type(improc).__name__.startswith("Qwen2VLImageProcessor")
    rows = model.get_input_embeddings().weight.shape[0]
    assert rows % 64 == 0 and len(tok) <= rows < len(tok) + 64
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert model.config.image_token_id == tok.convert_tokens_to_ids(IMAGE_PAD)
    assert model.generation_config.eos_token_id == tok.convert_tokens_to_ids(IM_END) == tok.eos_token_id
    assert tok.pad_token == "<|endoftext|>"
    assert 0.3e6 < sum(p.numel() for p in model.parameters()) < 3e6


def test_tiny_model_generates_greedily_from_a_chat_templated_image_prompt(loaded, synth_data_dir):
    import torch

    model, tok, improc = loaded
    records = list(iter_jsonl(synth_data_dir / "val.jsonl"))
    inputs = _encode_prompt(records[0], synth_data_dir, tok, improc)
    grid = inputs["image_grid_thw"][0]
    n_pads = int((inputs["input_ids"] == model.config.image_token_id).sum())
    assert n_pads == int(grid.prod()) // 4 and inputs["pixel_values"].shape[0] == int(grid.prod())
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=6, do_sample=False)
        again = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    prompt_len = inputs["input_ids"].shape[1]
    new = out[0, prompt_len:]
    assert 1 <= len(new) <= 6 and torch.equal(out, again)
    assert isinstance(tok.decode(new, skip_special_tokens=False), str)
    # The image reaches the logits: another picture changes them.
    other = _encode_prompt(records[1], synth_data_dir, tok, improc)
    with torch.no_grad():
        a = model(**inputs).logits[0, -1]
        b = model(**other).logits[0, -1]
    assert not torch.allclose(a, b)


def test_every_coord_token_is_one_id_contiguous_in_bin_order_and_decodes_back(loaded, tiny_model_dir):
    model, tok, _ = loaded
    ids = require_coord_tokens(tok, tiny_model_dir)  # checks encode == [id] and decode == token for all 1000
    first, last = contiguous_range(ids)
    assert last - first == 999 and last < model.get_input_embeddings().weight.shape[0]
    assert tok.convert_ids_to_tokens(first + 110) == "<|coord_110|>"
    # Chat special tokens are single ids too, below the coord block.
    specials = tok.convert_tokens_to_ids(list(CHAT_SPECIAL_TOKENS))
    assert all(tok.encode(t, add_special_tokens=False) == [i] for t, i in zip(CHAT_SPECIAL_TOKENS, specials))
    assert specials == list(range(specials[0], specials[0] + len(specials))) and specials[-1] < first
    # Coord tokens are not special: skip_special_tokens keeps them, drops <|im_end|>.
    text = tok.decode([first + 5, tok.convert_tokens_to_ids(IM_END)], skip_special_tokens=True)
    assert text == "<|coord_5|>"


def test_a_serialized_gt_answer_round_trips_through_the_tokenizer(loaded, synth_data_dir):
    _, tok, _ = loaded
    coord_ids = coord_token_ids(tok)
    bin_of = {i: k for k, i in enumerate(coord_ids)}
    for rec in iter_jsonl(synth_data_dir / "val.jsonl"):
        objs = canonical_order(rec.objects)
        answer = serialize_objects(objs) + IM_END
        ids = tok.encode(answer, add_special_tokens=False)
        assert tok.decode(ids, skip_special_tokens=False) == answer
        assert [bin_of[i] for i in ids if i in bin_of] == [k for o in objs for k in o.bins]
        assert ids[-1] == tok.convert_tokens_to_ids(IM_END)
    # The whole teacher-forced conversation renders and round-trips as well.
    msgs = build_messages(rec, rec.image_paths(synth_data_dir), assistant=serialize_objects(objs))
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text.endswith(serialize_objects(objs) + IM_END + "\n")
    assert tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=False) == text


def test_auto_processor_is_blocked_without_torchvision_and_an_image_only_processor_matches_manual_encoding(
    loaded, tiny_model_dir, synth_data_dir
):
    """transformers 5.x AutoProcessor always builds the Qwen2-VL *video* processor, which needs
    torchvision (huggingface/transformers#48558). An image-only subclass is enough for tandem."""
    import torch
    from PIL import Image
    from transformers import AutoProcessor, Qwen2_5_VLProcessor
    from transformers.processing_utils import ProcessorMixin

    if HAS_TORCHVISION:
        processor = AutoProcessor.from_pretrained(tiny_model_dir)
    else:
        with pytest.raises(ImportError, match="[Tt]orchvision"):
            AutoProcessor.from_pretrained(tiny_model_dir)

        class ImageOnlyQwen2_5_VLProcessor(Qwen2_5_VLProcessor):
            def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
                self.image_token, self.video_token = IMAGE_PAD, "<|video_pad|>"
                self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
                self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
                ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)

        processor = ImageOnlyQwen2_5_VLProcessor.from_pretrained(tiny_model_dir)
    _, tok, improc = loaded
    rec = next(iter_jsonl(synth_data_dir / "train.jsonl"))
    paths = rec.image_paths(synth_data_dir)
    text = processor.apply_chat_template(build_messages(rec, paths), tokenize=False, add_generation_prompt=True)
    got = processor(text=[text], images=[Image.open(p).convert("RGB") for p in paths], return_tensors="pt")
    want = _encode_prompt(rec, synth_data_dir, tok, improc)
    for key in ("input_ids", "image_grid_thw", "pixel_values", "mm_token_type_ids"):
        assert torch.equal(got[key].to(want[key].dtype), want[key]), key


def test_tiny_model_build_is_skipped_when_up_to_date(tiny_model_dir):
    from tools.make_tiny_model import BUILD_FILE, ensure_tiny_model

    stamp = (tiny_model_dir / BUILD_FILE).stat().st_mtime_ns
    assert ensure_tiny_model(tiny_model_dir) == tiny_model_dir
    assert (tiny_model_dir / BUILD_FILE).stat().st_mtime_ns == stamp


def test_a_pool_initialised_model_loads_finite_with_unit_norms_zero_biases_and_the_usual_weight_scale(tmp_path):
    import torch
    from transformers import AutoModelForImageTextToText

    from tools.make_tiny_model import BUILD_FILE, ensure_tiny_model

    out = ensure_tiny_model(tmp_path / "pool", init="pool")
    assert json.loads((out / BUILD_FILE).read_text())["params"]["init"] == "pool"  # its own cache key
    named = dict(AutoModelForImageTextToText.from_pretrained(out).named_parameters())
    assert all(torch.isfinite(p).all() for p in named.values())
    norms = [p for n, p in named.items() if "norm" in n and n.endswith("weight")]
    biases = [p for n, p in named.items() if n.endswith("bias")]
    assert norms and all(bool((p == 1).all()) for p in norms) and biases and all(not p.any() for p in biases)
    big = [p for n, p in named.items() if p.dim() == 2 and "norm" not in n]
    std = torch.cat([p.detach().reshape(-1) for p in big]).std()
    assert 0.015 < float(std) < 0.025  # initializer_range 0.02
    assert not torch.equal(big[0].reshape(-1)[:64], big[1].reshape(-1)[:64])  # slices at different offsets


def test_every_preset_has_consistent_heads_mrope_sections_and_vision_output(loaded):
    from tools.make_tiny_model import PRESETS, build_config

    _, tok, _ = loaded
    for name in PRESETS:
        cfg = build_config(name, tok)
        text, vision = cfg.text_config, cfg.vision_config
        head_dim = text.hidden_size // text.num_attention_heads
        assert head_dim * text.num_attention_heads == text.hidden_size, name
        assert text.num_attention_heads % text.num_key_value_heads == 0, name
        assert sum(text.rope_parameters["mrope_section"]) == head_dim // 2, name
        assert vision.out_hidden_size == text.hidden_size and vision.patch_size == 14, name
        assert vision.hidden_size % vision.num_heads == 0 and (vision.hidden_size // vision.num_heads) % 4 == 0, name
    assert build_config("7b", tok).tie_word_embeddings is False


def test_add_coord_tokens_fixes_a_model_without_them(tmp_path):
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from tools.add_coord_tokens import AddCoordTokensError, add_coord_tokens
    from tools.make_tiny_model import ensure_tiny_model

    bare = ensure_tiny_model(tmp_path / "bare", coord_tokens=False)
    tok = AutoTokenizer.from_pretrained(bare)
    with pytest.raises(CoordTokenError) as info:
        require_coord_tokens(tok, bare)
    assert f"python tools/add_coord_tokens.py --model {bare} --out {bare}-coord" in str(info.value)
    assert "lacks the 1000 <|coord_k|> tokens" in str(info.value)

    before = AutoModelForImageTextToText.from_pretrained(bare).get_input_embeddings().weight.detach().clone()
    summary = add_coord_tokens(bare, tmp_path / "fixed")
    fixed_tok = AutoTokenizer.from_pretrained(tmp_path / "fixed")
    ids = require_coord_tokens(fixed_tok, tmp_path / "fixed")
    assert contiguous_range(ids) == (len(tok), len(tok) + 999) == summary["coord_id_range"]
    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "fixed")
    emb = model.get_input_embeddings().weight
    assert emb.shape[0] % 64 == 0 and emb.shape[0] >= len(fixed_tok) == len(tok) + 1000
    assert model.config.get_text_config().vocab_size == emb.shape[0]
    assert torch.equal(emb[: len(tok)], before[: len(tok)])  # existing rows untouched
    assert torch.allclose(emb[ids], before[: len(tok)].mean(0).expand(1000, -1))
    for name in ("preprocessor_config.json", "processor_config.json", "chat_template.jinja"):
        assert (tmp_path / "fixed" / name).is_file()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[ids[0], ids[500], ids[999]]])).logits
    assert logits.shape[-1] == emb.shape[0] and torch.isfinite(logits).all()
    with pytest.raises(CoordTokenError):  # the source directory is left as it was
        coord_token_ids(AutoTokenizer.from_pretrained(bare))
    with pytest.raises(AddCoordTokensError, match="already has"):
        add_coord_tokens(tmp_path / "fixed", tmp_path / "twice")
