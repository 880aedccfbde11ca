"""``megashard convert --to hf`` / HF import without Megatron or transformers: refusals before
anything is written, hostile Hugging Face directories, and the export's memory bound."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

import megashard
from megashard.cli import main as cli_main
from megashard.convert import ConvertInputError, convert
from megashard.errors import CheckpointError
from megashard.hf.safetensors import SafetensorsWriter
from megashard.sharded import ShardedTensor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_hf(d, layers=2, hidden=64, ffn=96, heads=4, groups=2, vocab=100, seed=0, **cfg_extra) -> None:
    """A random HF Llama directory, written tensor by tensor (never the whole model in memory)."""
    from megashard.hf.importer import expected
    from megashard.hf.mapping import spec_from_hf_config

    os.makedirs(d)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
           "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": groups, "vocab_size": vocab, "rms_norm_eps": 1e-5, "max_position_embeddings": 64,
           "tie_word_embeddings": False, **cfg_extra}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    specs = [(n, torch.float32, s) for n, s in expected(spec_from_hf_config(cfg, str(d)))]
    w = SafetensorsWriter(os.path.join(d, "model.safetensors"), specs)
    g = torch.Generator().manual_seed(seed)
    for n, _, s in specs:
        w.write(n, torch.randn(s, generator=g))
    w.close()


def llama_args(**kw) -> argparse.Namespace:
    a = dict(num_layers=1, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, group_query_attention=True,
             num_query_groups=2, kv_channels=16, normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
             untie_embeddings_and_output_weights=True, add_bias_linear=False, padded_vocab_size=128)
    a.update(kw)
    return argparse.Namespace(**a)


def save_fake(path, args) -> None:
    """A one-layer Megatron-keyed checkpoint (only the embedding: enough for the checks before reading)."""
    emb = torch.zeros(128, 64)
    megashard.save({"args": args, "model": {"e": ShardedTensor("embedding.word_embeddings.weight", emb, (128, 64),
                                                              (0, 0))}}, str(path))


def leftovers(parent) -> list:
    return [n for n in os.listdir(parent) if n.startswith(".")]


@pytest.mark.parametrize("change, flag", [
    ({"normalization": "LayerNorm"}, "--normalization"),
    ({"swiglu": False}, "--swiglu"),
    ({"position_embedding_type": "learned_absolute"}, "--position-embedding-type"),
    ({"num_experts": 8, "moe_shared_expert_intermediate_size": 64}, "--moe-shared-expert-intermediate-size"),
    ({"num_experts": 8, "moe_router_score_function": "sigmoid"}, "--moe-router-score-function"),
    ({"num_experts": 8, "moe_router_pre_softmax": True}, "--moe-router-pre-softmax"),
    ({"num_experts": 8, "moe_router_enable_expert_bias": True}, "--moe-router-enable-expert-bias"),
    ({"num_experts": 8, "moe_router_num_groups": 2, "moe_router_group_topk": 1}, "--moe-router-num-groups"),
    ({"num_experts": 8, "moe_expert_capacity_factor": 1.0}, "--moe-expert-capacity-factor"),
    ({"num_experts": 8, "moe_layer_freq": [1, 0]}, "--moe-layer-freq"),
    ({"num_experts": 8, "add_bias_linear": True}, "--add-bias-linear"),
    ({"num_experts": 8, "moe_router_topk": 9}, "--moe-router-topk"),
    ({"qk_layernorm": True}, "--qk-layernorm"),
    ({"add_bias_linear": False, "add_qkv_bias": True}, "--add-qkv-bias"),
])
def test_unsupported_flags_refused_before_writing(tmp_path, change, flag):
    save_fake(tmp_path / "ckpt", llama_args(**change))
    with pytest.raises(ConvertInputError) as e:
        convert(str(tmp_path / "ckpt"), str(tmp_path / "hf"), to="hf", vocab_size=100)
    assert flag in str(e.value) and "nothing was written" in str(e.value)
    assert not os.path.exists(tmp_path / "hf") and not leftovers(tmp_path)


def test_vocabulary_must_be_given_and_fit(tmp_path, capsys):
    save_fake(tmp_path / "ckpt", llama_args())
    assert cli_main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--to", "hf"]) == 2
    assert "--vocab-size N or --tokenizer DIR" in capsys.readouterr().err
    with pytest.raises(ConvertInputError, match="larger than the checkpoint's 128 embedding rows"):
        convert(str(tmp_path / "ckpt"), str(tmp_path / "hf"), to="hf", vocab_size=129)
    with pytest.raises(ConvertInputError, match="apply to --to hf"):
        convert(str(tmp_path / "ckpt"), str(tmp_path / "x"), to="safetensors", vocab_size=100)
    # the tokenizer's size is the largest id of its vocabulary and added tokens, plus one
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0, "b": 1}},
                                                    "added_tokens": [{"id": 140, "content": "<x>"}]}))
    with pytest.raises(ConvertInputError, match="vocabulary of 141 is larger"):
        convert(str(tmp_path / "ckpt"), str(tmp_path / "hf"), to="hf", tokenizer=str(tok))
    assert not os.path.exists(tmp_path / "hf") and not leftovers(tmp_path)


def test_norm_epsilon_read_under_megatron_lms_name():
    # Megatron-LM's parser stores --norm-epsilon as args.layernorm_epsilon (TransformerConfig's field): the
    # export wrote rms_norm_eps 1e-5 for a model trained with 1e-6
    from megashard.hf.mapping import spec_from_megatron_args

    s = spec_from_megatron_args(llama_args(layernorm_epsilon=1e-6), 100, 128, torch.float32, "ckpt")
    assert s.hf_config()["rms_norm_eps"] == 1e-6
    assert s.megatron_args()["layernorm_epsilon"] == 1e-6  # what an import records: Megatron-LM's name
    assert spec_from_megatron_args(llama_args(norm_epsilon=1e-6), 100, 128, torch.float32, "ckpt").eps == 1e-6
    assert spec_from_megatron_args(llama_args(), 100, 128, torch.float32, "ckpt").eps == 1e-5


def test_missing_layer_tensors_refused(tmp_path):
    save_fake(tmp_path / "ckpt", llama_args())  # args describe a layer the checkpoint does not hold
    with pytest.raises(ConvertInputError, match="no global tensor 'decoder.layers.self_attention"):
        convert(str(tmp_path / "ckpt"), str(tmp_path / "hf"), to="hf", vocab_size=100)


def test_hf_round_trip_bytes_and_tokenizer_copied(tmp_path):
    write_hf(tmp_path / "hf", bos_token_id=1, eos_token_id=2)
    res = convert(str(tmp_path / "hf"), str(tmp_path / "ms"))
    assert res.tensors == 2 * 9 + 3 and res.bytes == os.path.getsize(tmp_path / "hf" / "model.safetensors") - (
        8 + int.from_bytes(open(tmp_path / "hf" / "model.safetensors", "rb").read(8), "little"))
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {f"t{i}": i for i in range(100)}}}))
    (tok / "tokenizer_config.json").write_text("{}")
    convert(str(tmp_path / "ms"), str(tmp_path / "back"), to="hf", tokenizer=str(tok), shard_bytes=50_000)
    assert (tmp_path / "back" / "tokenizer.json").read_bytes() == (tok / "tokenizer.json").read_bytes()
    assert (tmp_path / "back" / "tokenizer_config.json").exists()
    cfg = json.load(open(tmp_path / "back" / "config.json"))
    assert cfg["bos_token_id"] == 1 and cfg["eos_token_id"] == 2 and cfg["num_key_value_heads"] == 2
    from safetensors.torch import load_file

    a = load_file(str(tmp_path / "hf" / "model.safetensors"))
    idx = json.load(open(tmp_path / "back" / "model.safetensors.index.json"))
    b = {}
    for f in sorted(set(idx["weight_map"].values())):
        b.update(load_file(str(tmp_path / "back" / f)))
    assert sorted(a) == sorted(b) == sorted(idx["weight_map"])
    assert all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    assert idx["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in a.values())


MIXTRAL = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": 4,
           "num_experts_per_tok": 2}


def test_mixtral_round_trip_bytes_and_refusals(tmp_path):
    write_hf(tmp_path / "hf", **MIXTRAL)
    res = convert(str(tmp_path / "hf"), str(tmp_path / "ms"))
    assert res.tensors == 2 * (7 + 3 * 4) + 3
    # the experts are one expert-stacked global tensor per projection, [layers, experts, ...]
    m = megashard.load_consolidated(str(tmp_path / "ms" / "release"))
    assert m["decoder.layers.mlp.experts.experts.linear_fc1.weight"].shape == (2, 4, 192, 64)
    assert m["decoder.layers.mlp.router.weight"].shape == (2, 4, 64)
    convert(str(tmp_path / "ms"), str(tmp_path / "back"), to="hf", shard_bytes=50_000)
    cfg = json.load(open(tmp_path / "back" / "config.json"))
    assert {k: cfg[k] for k in MIXTRAL} == MIXTRAL and cfg["intermediate_size"] == 96
    from safetensors.torch import load_file

    a = load_file(str(tmp_path / "hf" / "model.safetensors"))
    idx = json.load(open(tmp_path / "back" / "model.safetensors.index.json"))
    b = {}
    for f in sorted(set(idx["weight_map"].values())):
        b.update(load_file(str(tmp_path / "back" / f)))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    w1 = a["model.layers.1.block_sparse_moe.experts.2.w1.weight"]
    assert torch.equal(m["decoder.layers.mlp.experts.experts.linear_fc1.weight"][1, 2, :96], w1)
    # what the Mixtral mapping does not cover is refused before anything is written
    import shutil

    for name, extra, msg in (("sw", {"sliding_window": 4096}, "sliding_window"),
                             ("k", {"num_experts_per_tok": 5}, "num_experts_per_tok 5 > num_local_experts 4"),
                             ("bias", {"attention_bias": True, "mlp_bias": True}, "Mixtral with biases")):
        shutil.copytree(tmp_path / "hf", tmp_path / name)
        json.dump({**json.load(open(tmp_path / "hf" / "config.json")), **extra},
                  open(tmp_path / name / "config.json", "w"))
        with pytest.raises(ConvertInputError, match=msg):
            convert(str(tmp_path / name), str(tmp_path / f"{name}.out"))
        assert not os.path.exists(tmp_path / f"{name}.out")


def test_hostile_hf_directories_refused(tmp_path, capsys):
    """Damaged or hostile files (and a symbolic link) are wrong input: exit 2, one line, nothing written."""
    write_hf(tmp_path / "ok")
    st = tmp_path / "ok" / "model.safetensors"
    raw = st.read_bytes()
    hlen = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + hlen])

    def variant(name, header_doc=None, data=None, cfg=None):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(cfg if cfg is not None else (tmp_path / "ok" / "config.json").read_text())
        if data is None:
            h = json.dumps(header_doc).encode()
            data = len(h).to_bytes(8, "little") + h + raw[8 + hlen:]
        (d / "model.safetensors").write_bytes(data)
        return d

    first = next(k for k in header if k != "__metadata__")
    past = dict(header, **{first: dict(header[first], data_offsets=[0, len(raw)])})
    second = [k for k in header if k != "__metadata__"][1]
    overlap = dict(header, **{second: dict(header[second], data_offsets=header[first]["data_offsets"])})
    cases = {
        variant("huge_header", data=(1 << 60).to_bytes(8, "little") + b"{}"): "header length",
        variant("past_end", past): "do not hold",
        variant("overlap", overlap): "overlap",
        variant("bad_dtype", dict(header, **{first: dict(header[first], dtype="X9")})): "unsupported dtype",
        variant("bad_cfg", header, cfg=json.dumps({"model_type": "gpt2"})): "Llama-family",
    }
    link = tmp_path / "link"
    link.mkdir()
    (link / "config.json").write_text((tmp_path / "ok" / "config.json").read_text())
    os.symlink(st, link / "model.safetensors")
    cases[link] = "symbolic link is refused"
    fifo = tmp_path / "fifo"  # a named pipe where the index is: opening it must not wait for a writer
    fifo.mkdir()
    (fifo / "config.json").write_text((tmp_path / "ok" / "config.json").read_text())
    os.link(st, fifo / "model.safetensors")
    os.mkfifo(fifo / "model.safetensors.index.json")
    cases[fifo] = "not a regular file"
    fifo_shard = tmp_path / "fifo_shard"
    fifo_shard.mkdir()
    (fifo_shard / "config.json").write_text((tmp_path / "ok" / "config.json").read_text())
    (fifo_shard / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {first: "pipe"}}))
    os.mkfifo(fifo_shard / "pipe")
    cases[fifo_shard] = "not a regular file"
    deep = variant("deep_header", data=(200_008).to_bytes(8, "little") + b"[" * 100_000 + b"]" * 100_000 + b"\0" * 8)
    cases[deep] = "nested too deeply"
    for d, msg in cases.items():
        with pytest.raises(CheckpointError, match=msg):
            convert(str(d), str(tmp_path / f"out_{d.name}"))
        capsys.readouterr()
        assert cli_main(["convert", str(d), str(tmp_path / f"out_{d.name}")]) == 2, d
        err = capsys.readouterr().err
        assert err.startswith("megashard convert: error: ") and err.count("\n") == 1 and msg in err, err
        assert not os.path.exists(tmp_path / f"out_{d.name}"), d


MEASURE = r"""
import resource, sys
import megashard.hf.export, megashard.convert  # imports first: the baseline holds them
from megashard.convert import convert
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
res = convert(sys.argv[1], sys.argv[2], to="hf", batch_bytes=1 << 20)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(base, peak, res.bytes)
"""


def test_export_memory_stays_far_below_model_size(tmp_path):
    """A ~540 MB model (12 layers of 45 MB) exports in well under 160 MB above the interpreter's
    baseline: about two layers (the one being written, the next being read), never the model."""
    write_hf(tmp_path / "hf", layers=12, hidden=1024, ffn=2816, heads=8, groups=2, vocab=1000)
    convert(str(tmp_path / "hf"), str(tmp_path / "ms"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p),
               OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", MEASURE, str(tmp_path / "ms"), str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    base, peak, nbytes = map(int, p.stdout.split()[-3:])
    bound = 160 << 20
    assert nbytes > 3 * bound
    assert peak - base < bound, f"peak {peak >> 20} MiB over a {base >> 20} MiB baseline for a {nbytes >> 20} MiB model"


def test_padding_rows_past_the_saved_vocabulary_load_as_padding(tmp_path):
    """An import saves the real vocabulary; a TP rank whose padded rows are all past it keeps its
    own values (allow_shape_mismatch), while a rank with real rows gets them."""
    from megashard.errors import StateDictError

    real = torch.arange(100 * 4, dtype=torch.float32).view(100, 4)
    megashard.save({"e": ShardedTensor("embedding.word_embeddings.weight", real, (100, 4), (0, 0))}, str(tmp_path / "c"))
    first, second = torch.full((128, 4), -1.0), torch.full((128, 4), -1.0)
    megashard.load({"a": ShardedTensor("embedding.word_embeddings.weight", first, (256, 4), (0, 0),
                                       allow_shape_mismatch=True),
                    "b": ShardedTensor("embedding.word_embeddings.weight", second, (256, 4), (128, 0),
                                       allow_shape_mismatch=True)}, str(tmp_path / "c"))
    assert torch.equal(first[:100], real) and (first[100:] == -1).all() and (second == -1).all()
    with pytest.raises(StateDictError, match="shape mismatch"):
        megashard.load({"b": ShardedTensor("embedding.word_embeddings.weight", second, (256, 4), (128, 0))},
                       str(tmp_path / "c"))


# ---------------------------------------------------------------------------
# hostile or malformed config.json: exit 2, one error line, memory bounded by the files

FORK_CLI = r"""
import json, os, resource, sys, traceback
import megashard.cli, megashard.convert, megashard.hf.importer  # imported once; each case runs in a fork

def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(key + ":"))  # KiB

results = []
for argv, err in json.loads(sys.argv[1]):
    sys.stdout.flush(); sys.stderr.flush()
    # memory, not time: a run that enumerates what the files do not hold fails here, not in the machine
    limit = status("VmSize") * 1024 + (1 << 30)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            with open(err + ".rss", "w") as f:  # the fork's own resident set at its start: the baseline
                f.write(str(status("VmRSS")))
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 2)
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
            try:
                code = megashard.cli.main(argv)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush(); sys.stderr.flush()
        finally:
            os._exit(code)
    _, st, ru = os.wait4(pid, 0)
    with open(err + ".rss") as f:
        results.append({"code": os.waitstatus_to_exitcode(st), "grew_kib": ru.ru_maxrss - int(f.read())})
print(json.dumps(results))
"""


def run_cli_cases(cases, tmp_path):
    """Run ``megashard`` command lines in forks of one subprocess: [(exit code, stderr, KiB grown)]."""
    errs = [str(tmp_path / f"stderr.{i}") for i in range(len(cases))]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p),
               OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", FORK_CLI, json.dumps(list(zip(cases, errs)))], capture_output=True,
                       text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.splitlines()[-1])
    return [(r["code"], open(e).read(), r["grew_kib"]) for r, e in zip(res, errs)]


_DEEP = "[" * 100_000 + "]" * 100_000
#: config.json changes (a dict merged in, or the raw text) -> what the error line names
HOSTILE_CONFIGS = [
    ({"num_hidden_layers": 2**40}, "num_hidden_layers=1099511627776"),
    ({"num_hidden_layers": 3}, "num_hidden_layers=3"),
    ({"num_hidden_layers": 1}, "num_hidden_layers=1"),
    ({"num_hidden_layers": 0}, "num_hidden_layers=0"),
    ({"num_hidden_layers": -2}, "num_hidden_layers=-2"),
    ({"num_hidden_layers": True}, "num_hidden_layers=True"),
    ({"num_hidden_layers": "2"}, "num_hidden_layers='2'"),
    ({"num_hidden_layers": 2.5}, "num_hidden_layers=2.5"),
    ('"num_hidden_layers": NaN', "num_hidden_layers=nan"),
    ('"num_hidden_layers": 1e400', "num_hidden_layers=inf"),
    ({"num_hidden_layers": [2]}, "num_hidden_layers=[2]"),
    ({"hidden_size": 2**40}, "model.embed_tokens.weight"),
    ({"vocab_size": 2**40}, "model.embed_tokens.weight"),
    ({"intermediate_size": 10**12}, "gate_proj"),
    ({"num_attention_heads": 1000}, "num_attention_heads"),
    ({"num_key_value_heads": 0}, "num_key_value_heads=0"),
    ({"head_dim": 2**40}, "q_proj"),
    ('"rms_norm_eps": NaN', "rms_norm_eps=nan"),
    ({"rms_norm_eps": -1e-5}, "rms_norm_eps=-1e-05"),
    ({"hidden_size": None}, "hidden_size=None"),
    ("-hidden_size", "no hidden_size"),
    ("-vocab_size", "no vocab_size"),
    ({"rope_scaling": {"rope_type": "llama3"}}, "rope_scaling"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": "eight"}}, "factor"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": -8.0}}, "factor"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": {}}}, "low_freq_factor"),
    ({"rope_scaling": [1, 2]}, "rope_scaling"),
    ({"rope_parameters": {"rope_theta": "big"}}, "rope_theta"),
    ({"rope_theta": None, "rope_parameters": {"rope_type": "default", "rope_theta": [1]}}, "rope_theta"),
    ({"torch_dtype": ["float32"]}, "torch_dtype"),
    ({"dtype": {"x": 1}}, "dtype"),
    ({"model_type": ["llama"]}, "model_type"),
    ({"architectures": "LlamaForCausalLM"}, "architectures"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings"),
    ({"attention_bias": "no", "mlp_bias": "no"}, "attention_bias"),
    ({"bos_token_id": {"a": [[1e308]]}}, "bos_token_id"),
    ({"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "num_local_experts": 2**40,
      "num_experts_per_tok": 2}, "num_local_experts=1099511627776"),
    ("[]", "not a JSON object"),
    (_DEEP, "config.json"),
    ('{"model_type": ' + _DEEP[:20000] + _DEEP[-20000:] + "}", "config.json"),
]


def test_hostile_configs_exit_2_with_one_line_and_bounded_memory(tmp_path):
    """Every malformed or hostile config.json: exit 2, one `megashard convert: error:` line, no
    traceback, and the memory the (small) files justify -- never one allocation per claimed layer."""
    write_hf(tmp_path / "ok")
    good = json.loads((tmp_path / "ok" / "config.json").read_text())
    cases, dirs = [], []
    for i, (change, _) in enumerate(HOSTILE_CONFIGS):
        d = tmp_path / f"c{i}"
        d.mkdir()
        os.link(tmp_path / "ok" / "model.safetensors", d / "model.safetensors")
        if isinstance(change, dict):
            text = json.dumps({**good, **change})
        elif change.startswith("-"):
            text = json.dumps({k: v for k, v in good.items() if k != change[1:]})
        elif change.startswith('"'):
            text = json.dumps(good)[:-1] + ", " + change + "}"
        else:
            text = change
        (d / "config.json").write_text(text)
        cases.append(["convert", str(d), str(tmp_path / f"out{i}")])
        dirs.append(d)
    for (change, names), (code, err, grew), d in zip(HOSTILE_CONFIGS, run_cli_cases(cases, tmp_path), dirs):
        what = f"{str(change)[:80]}: exit {code}, {grew} KiB, {err[-2000:]!r}"
        assert code == 2, what
        assert err.startswith("megashard convert: error: ") and err.count("\n") == 1, what
        assert "Traceback" not in err and names in err and len(err) < 1000, what
        assert grew < 64 << 10, what  # the files are ~100 KiB; the interpreter's own growth is far below this
        assert not os.path.exists(tmp_path / f"out{d.name[1:]}")


def _padded_checkpoint(tmp_path, **args_extra):
    """A Megatron-like checkpoint whose embedding and output layer are padded to 128 rows (rows 100..127 are
    padding, set to 7), its args saying vocab_size=100 and padded_vocab_size=128."""
    write_hf(tmp_path / "hf", vocab=100)
    convert(str(tmp_path / "hf"), str(tmp_path / "ms"))
    src = str(tmp_path / "ms" / "release")
    tensors = megashard.load_consolidated(src)
    args = megashard.load_common(src, ["args"])["args"]
    vars(args).update(padded_vocab_size=128, **args_extra)
    model = {}
    for k, t in tensors.items():
        if k in ("embedding.word_embeddings.weight", "output_layer.weight"):
            t = torch.cat([t, torch.full((28, t.shape[1]), 7.0, dtype=t.dtype)])
        model[k] = ShardedTensor(k, t, tuple(t.shape), (0,) * t.dim())
    megashard.save({"args": args, "model": model}, str(tmp_path / "pad"))
    return str(tmp_path / "pad")


def test_export_takes_the_vocabulary_from_the_saved_args(tmp_path, capsys):
    """The saved args' vocab_size is the vocabulary: no --vocab-size needed, and a smaller one (which
    would drop trained rows) is refused, naming both sizes; a larger one (padding rows) is warned about."""
    from safetensors.torch import load_file

    pad = _padded_checkpoint(tmp_path)
    res = convert(pad, str(tmp_path / "out"), to="hf")
    assert json.load(open(tmp_path / "out" / "config.json"))["vocab_size"] == 100
    got = load_file(str(tmp_path / "out" / "model.safetensors")) if os.path.exists(
        tmp_path / "out" / "model.safetensors") else {}
    idx = json.load(open(tmp_path / "out" / "model.safetensors.index.json"))
    for f in sorted(set(idx["weight_map"].values())):
        got.update(load_file(str(tmp_path / "out" / f)))
    orig = load_file(str(tmp_path / "hf" / "model.safetensors"))
    for k in ("model.embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(got[k], orig[k]), k
    assert res.tensors == len(orig)
    capsys.readouterr()
    assert cli_main(["convert", pad, str(tmp_path / "small"), "--to", "hf", "--vocab-size", "90"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ("megashard convert: error: --vocab-size 90 is smaller than the vocabulary the "
                                     "checkpoint was trained with (100, its saved args' vocab_size)") in err, err
    assert not os.path.exists(tmp_path / "small")
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {f"t{i}": i for i in range(95)}}}))
    with pytest.raises(ConvertInputError, match=r"the tokenizer's 95 tokens are fewer than the vocabulary the "
                       r"checkpoint was trained with \(100"):
        convert(pad, str(tmp_path / "small"), to="hf", tokenizer=str(tok))
    import logging

    with pytest.MonkeyPatch.context() as mp:
        records = []
        mp.setattr(logging.getLogger("megashard.hf.export"), "warning", lambda *a: records.append(a[0] % a[1:]))
        convert(pad, str(tmp_path / "big"), to="hf", vocab_size=110)
    assert json.load(open(tmp_path / "big" / "config.json"))["vocab_size"] == 110
    assert any("rows 100..109 are padding" in r for r in records), records


def test_export_null_tokenizer_vocabulary_counts_its_eod(tmp_path):
    """Megatron's NullTokenizer has vocab_size + 1 tokens (its eod is id vocab_size): that row is exported."""
    pad = _padded_checkpoint(tmp_path, vocab_size=99, tokenizer_type="NullTokenizer")
    convert(pad, str(tmp_path / "out"), to="hf")
    assert json.load(open(tmp_path / "out" / "config.json"))["vocab_size"] == 100
