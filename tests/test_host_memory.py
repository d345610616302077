"""Host memory: what loading holds at its peak, and the plan checked before the weights load.

A checkpoint's routed experts (63 GiB for Qwen3.8-Flash-Next in NVFP4) and its n-gram table (95 GiB in bf16)
go to (pinned) host memory; the seed's machine has 123 GB of RAM. Loading must hold each of them once, not
stacked copies of them, and a host that cannot hold them is told so before the load starts.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from safetensors.torch import save_file

from ft.model import qwen3_next
from ft.model.checkpoint import CheckpointReader, load_weights
from ft.model.config import ModelConfig
from ft.tools.demo import ensure_demo_checkpoint


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return ensure_demo_checkpoint(tmp_path_factory.mktemp("demo"))


class _Spy(CheckpointReader):
    """A reader that keeps a weak reference to every routed-expert tensor it returns and records, at each
    read, how many of those it returned before are still alive (held by the loader)."""

    def __init__(self, path) -> None:
        super().__init__(path)
        self.alive: list[weakref.ref] = []
        self.most_alive = 0

    def get(self, name: str) -> torch.Tensor:
        t = super().get(name)
        if ".mlp.experts." in name:
            self.alive = [r for r in self.alive if r() is not None]
            self.most_alive = max(self.most_alive, len(self.alive))
            self.alive.append(weakref.ref(t))
        return t


def test_experts_are_copied_into_the_store_as_they_are_read(demo):
    cfg = ModelConfig.from_file(demo)
    specs, experts = qwen3_next.tensor_specs(cfg)
    reader = _Spy(demo)
    store = load_weights(reader, specs, experts, torch.float32, torch.device("cpu"), torch.device("cpu")).experts
    n_layers, n_exp = len(experts), len(experts[0])
    read = n_layers * n_exp * 9  # gate, up, down: packed, block scales, second scale each
    assert len(reader.alive) and reader.most_alive <= 9 < read  # one expert's tensors at a time, not all of them
    # the store holds what the checkpoint holds, where the kernels expect it
    plain = CheckpointReader(demo)
    for layer, e in ((0, 0), (n_layers - 1, n_exp - 1), (n_layers // 2, n_exp // 2)):
        gate, up, down = (n.removesuffix(".weight") for n in experts[layer][e])
        assert torch.equal(store.w13[layer, e], torch.cat([plain.get(gate + ".weight"), plain.get(up + ".weight")]))
        assert torch.equal(store.w2[layer, e], plain.get(down + ".weight"))
        assert torch.equal(store.w13_scale[layer, e].view(torch.uint8),
                           torch.cat([plain.get(gate + ".weight_scale"), plain.get(up + ".weight_scale")]).view(torch.uint8))
        assert torch.equal(store.w2_scale[layer, e].view(torch.uint8), plain.get(down + ".weight_scale").view(torch.uint8))
        assert store.scale_2[layer, e].tolist() == [float(plain.get(n + ".weight_scale_2")) for n in (gate, up, down)]


def test_a_table_is_read_in_pieces_of_rows(tmp_path):
    table = torch.randn(1000, 24).to(torch.bfloat16)
    save_file({"t.weight": table}, str(tmp_path / "model.safetensors"))
    reader = CheckpointReader(tmp_path)
    assert torch.equal(reader.get_rows("t.weight", 17, 300), table[17:300])
    for piece in (1, 24 * 2 * 7, 1 << 20):  # a row a piece (a piece smaller than a row), 7 rows, the whole
        out = torch.empty(1000, 24, dtype=torch.bfloat16)
        reader.read_into("t.weight", out, piece_bytes=piece)
        assert torch.equal(out, table)
    with pytest.raises(Exception, match="read into"):
        reader.read_into("t.weight", torch.empty(999, 24, dtype=torch.bfloat16))


def _store_bytes(store) -> int:
    return sum(t.nbytes for t in (store.w13, store.w2, store.w13_scale, store.w2_scale, store.scale_2) if t is not None)


@pytest.mark.parametrize("layout", ["grouped", "one-tensor-each", "synthetic", "demo-nvfp4"])
def test_the_plan_is_what_loading_keeps_in_host_memory(layout, demo, tmp_path):
    """`planned_host_bytes`, from the checkpoint's headers (or a synthetic config) before anything loads,
    is to the byte what `load_model` then keeps in host memory: the expert store, the n-gram table (read
    from its parts), the embedding moved there."""
    import json

    from ft.engine.ranks.loader import load_model, planned_host_bytes
    from ft.engine.ranks.model_source import model_source
    from test_flash_next_engine import TEXT, write_checkpoint

    if layout == "demo-nvfp4":
        spec = str(demo)
    elif layout == "synthetic":
        (tmp_path / "config.json").write_text(json.dumps({
            "architectures": ["Qwen3_8_FlashNextForConditionalGeneration"],
            "text_config": {**TEXT, "shared_expert_intermediate_size": 32, "dtype": "bfloat16"}}))
        spec = f"synthetic:{tmp_path / 'config.json'}"
    else:
        write_checkpoint(tmp_path / "m", TEXT, split_experts=layout == "one-tensor-each")
        spec = str(tmp_path / "m")
    source = model_source(spec)
    cfg = ModelConfig.from_file(source.path)
    dtype, device = torch.float32, torch.device("cpu")
    plan = planned_host_bytes(source, cfg, dtype, host_embedding=True)
    model, store = load_model(source, cfg, dtype, device, seed=0, progress=False, embedding_on_host=True)
    kept = {"routed experts": _store_bytes(store), **model.host_tables}
    assert plan == kept and plan["routed experts"] > 0 and plan["embedding"] > 0
    assert ("n-gram table" in plan) == (layout != "demo-nvfp4")


def test_what_the_host_has_is_the_smaller_of_meminfo_and_the_cgroup(tmp_path):
    from ft.memory.host_memory import available_bytes

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       131072000 kB\nMemFree:          1000000 kB\nMemAvailable:   100000000 kB\n")
    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    v2.mkdir(), v1.mkdir()
    assert available_bytes(meminfo, v2, v1) == (100000000 * 1024, "MemAvailable")  # no cgroup files
    (v2 / "memory.max").write_text("max\n")
    (v2 / "memory.current").write_text("5\n")
    assert available_bytes(meminfo, v2, v1) == (100000000 * 1024, "MemAvailable")  # v2 without a limit
    (v2 / "memory.max").write_text(f"{64 << 30}\n")
    (v2 / "memory.current").write_text(f"{4 << 30}\n")
    assert available_bytes(meminfo, v2, v1) == (60 << 30, "the cgroup's limit")
    (v2 / "memory.max").unlink()
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    (v1 / "memory.usage_in_bytes").write_text("7\n")
    assert available_bytes(meminfo, v2, v1) == (100000000 * 1024, "MemAvailable")
    (v1 / "memory.limit_in_bytes").write_text(f"{8 << 30}\n")
    assert available_bytes(meminfo, v2, v1) == ((8 << 30) - 7, "the cgroup's limit")
    assert available_bytes(tmp_path / "none", tmp_path / "none", tmp_path / "none") is None


def test_a_plan_that_does_not_fit_is_refused_in_one_line():
    from ft.errors import ConfigError
    from ft.memory.host_memory import HostPlan

    gib = 1 << 30
    plan = HostPlan({"routed experts": 63 * gib, "n-gram table": 95 * gib}, (118 * gib, "MemAvailable"))
    with pytest.raises(ConfigError) as err:
        plan.check()
    text = str(err.value)
    assert "\n" not in text and "158.0 GiB" in text and "routed experts 63.0 GiB, n-gram table 95.0 GiB" in text \
        and "118.0 GiB available (MemAvailable)" in text and "--no-host-memory-check" in text \
        and "--ngram-table disk" in text
    HostPlan({"routed experts": 63 * gib}, (118 * gib, "MemAvailable")).check()  # fits: nothing raised
    HostPlan({"routed experts": 116 * gib}, (118 * gib, "MemAvailable")).check()  # the 2 GiB margin left
    with pytest.raises(ConfigError):
        HostPlan({"routed experts": 116 * gib + 1}, (118 * gib, "MemAvailable")).check()
    HostPlan({"routed experts": 1 << 50}, None).check()  # an unknown host is not refused


def test_the_engine_refuses_before_it_loads_and_loads_when_told_not_to_check(demo, monkeypatch):
    import ft.engine.ranks.rank_state as rank_state
    from ft.engine import LLM
    from ft.errors import ConfigError

    loads = []
    real_load = rank_state.load_model
    monkeypatch.setattr(rank_state, "load_model", lambda *a, **k: loads.append(1) or real_load(*a, **k))
    monkeypatch.setattr(rank_state, "available_bytes", lambda: (1 << 30, "MemAvailable"))
    with pytest.raises(ConfigError, match=r"host memory: this model keeps .*\(routed experts"):
        LLM(model=str(demo), device="cpu")
    assert not loads
    with LLM(model=str(demo), device="cpu", host_memory_check=False) as llm:
        assert loads and llm.engine.describe()["host_plan"]["available_bytes"] == 1 << 30


@pytest.mark.parametrize("advised", [4096, 4], ids=["advised", "threads"])
def test_a_paged_table_reads_rows_from_the_files_it_maps(tmp_path, monkeypatch, advised):
    import ft.model.paged_table as paged_table
    from ft.errors import CheckpointError
    from ft.model.paged_table import PagedTable

    monkeypatch.setattr(paged_table, "ADVISED_ROWS", advised)  # (4: the 9 rows below go to the reader threads)

    whole = torch.randn(50, 8).to(torch.bfloat16)
    save_file({"other": torch.ones(3), "t.weight": whole}, str(tmp_path / "a.safetensors"))
    save_file({"t.shard_0.weight": whole[:20].clone()}, str(tmp_path / "b.safetensors"))
    save_file({"t.shard_1.weight": whole[20:45].clone(), "t.shard_2.weight": whole[45:].clone()},
              str(tmp_path / "c.safetensors"))
    rows = torch.tensor([0, 49, 19, 20, 44, 45, 7, 7, 30])
    one = PagedTable.open([(tmp_path / "a.safetensors", "t.weight")], (50, 8))
    parts = PagedTable.open([(tmp_path / "b.safetensors", "t.shard_0.weight"),
                             (tmp_path / "c.safetensors", "t.shard_1.weight"),
                             (tmp_path / "c.safetensors", "t.shard_2.weight")], (50, 8))
    for table in (one, parts):  # (parts: the rows of two files' maps, each one select over its map's windows)
        assert table.shape == (50, 8) and table.dtype == torch.bfloat16 and table.nbytes == whole.nbytes
        assert torch.equal(table.gather(rows), whole[rows]) and torch.equal(table.gather(rows, plain=True), whole[rows])
    in_one_file = PagedTable.open([(tmp_path / "c.safetensors", "t.shard_1.weight"),
                                   (tmp_path / "c.safetensors", "t.shard_2.weight")], (30, 8))
    assert torch.equal(in_one_file.gather(rows - 20 * (rows >= 20)), whole[20:][rows - 20 * (rows >= 20)])
    with pytest.raises(CheckpointError, match="make \\[50, 8\\], expected \\[51, 8\\]"):
        PagedTable.open([(tmp_path / "a.safetensors", "t.weight")], (51, 8))
    with pytest.raises(CheckpointError, match="2-D bf16"):
        PagedTable.open([(tmp_path / "a.safetensors", "other")], (3, 1))


@pytest.mark.parametrize("loop_rows", [64, 4], ids=["loop", "numpy"])
def test_a_paged_tables_read_advice_covers_each_rows_first_page_once(tmp_path, monkeypatch, loop_rows):
    """`PagedTable.advice`: one call a page a row begins in, page-aligned, reaching that row's end; its map and
    offset found from the files' safetensors headers here."""
    import json
    import mmap
    import struct

    import ft.model.paged_table as paged_table
    from ft.model.paged_table import PagedTable

    monkeypatch.setattr(paged_table, "ADVICE_LOOP_ROWS", loop_rows)  # (the 11 rows below: by the loop, or numpy)
    width = 1000  # (2,000-byte rows: some cross a page, several share one)
    whole = torch.randn(60, width).to(torch.bfloat16)
    save_file({"pad": torch.ones(7), "t.shard_0.weight": whole[:25].clone()}, str(tmp_path / "b.safetensors"))
    save_file({"t.shard_1.weight": whole[25:40].clone(), "t.shard_2.weight": whole[40:].clone()},
              str(tmp_path / "c.safetensors"))
    parts = [(tmp_path / "b.safetensors", "t.shard_0.weight", 0), (tmp_path / "c.safetensors", "t.shard_1.weight", 25),
             (tmp_path / "c.safetensors", "t.shard_2.weight", 40)]
    table = PagedTable.open([(f, n) for f, n, _ in parts], (60, width))
    rows = torch.tensor([0, 1, 2, 24, 25, 26, 39, 40, 59, 2, 26])

    def where(r: int) -> tuple[int, int]:  # (the row's file, as a map index in file order, and its byte there)
        f, name, first = max((p for p in parts if p[2] <= r), key=lambda p: p[2])
        raw = f.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        begin = json.loads(raw[8:8 + n])[name]["data_offsets"][0]
        return (0 if f.name == "b.safetensors" else 1), 8 + n + begin + (r - first) * width * 2

    advice = table.advice(rows)
    keys = [(m, at) for m, at, _ in advice]
    assert len(keys) == len(set(keys)) and all(at % mmap.PAGESIZE == 0 for _, at in keys)
    want = {}
    for r in rows.tolist():
        m, lo = where(r)
        want.setdefault((m, lo - lo % mmap.PAGESIZE), lo + width * 2 - (lo - lo % mmap.PAGESIZE))
    assert {(m, at): length for m, at, length in advice} == want  # (a page's length: its first row's end)
    assert keys == list(want)  # (in the rows' order)
    assert table.advice(torch.tensor([], dtype=torch.int64)) == []
    assert torch.equal(table.gather(rows), whole[rows])


def test_auto_maps_the_ngram_table_when_the_host_cannot_hold_it(tmp_path, monkeypatch, caplog):
    """--ngram-table auto: the table in host memory where the plan fits; mapped from disk (and left out of the
    plan) where the plan with it does not fit but the plan without it does."""
    import logging

    import ft.engine.ranks.rank_state as rank_state
    from ft.engine import LLM
    from ft.engine.ranks.loader import planned_host_bytes
    from ft.engine.ranks.model_source import model_source
    from test_flash_next_engine import TEXT, write_checkpoint

    path = tmp_path / "m"
    write_checkpoint(path, TEXT)
    opts = dict(device="cpu", dtype="float32", page_size=16, num_tokens=256)
    with LLM(model=str(path), **opts) as llm:
        assert llm.engine.model.paged_table is None and "n-gram table" in llm.engine.host_plan.parts
    cfg = ModelConfig.from_file(path)
    full = planned_host_bytes(model_source(str(path)), cfg, torch.float32, False)
    from ft.memory.host_memory import HOST_MARGIN

    between = full["routed experts"] + HOST_MARGIN + full["n-gram table"] // 2
    monkeypatch.setattr(rank_state, "available_bytes", lambda: (between, "MemAvailable"))
    with caplog.at_level(logging.INFO, logger="ft.engine"), LLM(model=str(path), **opts) as llm:
        assert llm.engine.model.paged_table is not None and llm.engine.host_plan.parts == {
            "routed experts": full["routed experts"]}
        assert len(llm.generate(prompt_token_ids=[[5, 6, 7]], max_new_tokens=2)[0].token_ids) == 2
    assert "n-gram table: read from the checkpoint's files" in caplog.text


def test_a_tensor_parallel_rank_reads_only_its_part_of_every_expert(demo):
    """`load_weights(shard=(rank, world))` cuts each expert as it is read: the rank's store is its part of the
    whole store (`shard_expert_layer` of it), and no read expert outlives its copy."""
    from ft.model.tp_shard import shard_expert_layer

    cfg = ModelConfig.from_file(demo)
    specs, experts = qwen3_next.tensor_specs(cfg)
    cpu = torch.device("cpu")
    whole = load_weights(CheckpointReader(demo), specs, experts, torch.float32, cpu, cpu).experts
    for rank in (0, 1):
        reader = _Spy(demo)
        part = load_weights(reader, specs, experts, torch.float32, cpu, cpu, shard=(rank, 2)).experts
        assert reader.most_alive <= 9
        w13, s13, w2, s2 = shard_expert_layer(whole.w13, whole.w13_scale, whole.w2, whole.w2_scale, rank, 2)
        assert part.w13.shape[-2] * 2 == whole.w13.shape[-2]
        assert torch.equal(part.w13, w13) and torch.equal(part.w2, w2) and torch.equal(part.scale_2, whole.scale_2)
        assert torch.equal(part.w13_scale.view(torch.uint8), s13.view(torch.uint8))
        assert torch.equal(part.w2_scale.view(torch.uint8), s2.view(torch.uint8))


def test_a_read_ahead_gives_the_rows_a_plain_read_gives(tmp_path):
    """`HostNgramReader`: a span read ahead is taken by the step that asks for it (the same values as a plain
    read), a span no step asks for is dropped past `READ_AHEAD_SPANS`, an empty span reads nothing."""
    import ft.model.ngram_reader as ngram_reader
    from ft.model.layers.engram import EngramHashing
    from ft.model.ngram_reader import HostNgramReader
    from ft.model.paged_table import PagedTable

    hs = EngramHashing(heads_per_ngram=2, vocab_size_base=50, divisible_by=8, eos_token_id=2)
    table = torch.randn(hs.padded_rows, 6)
    save_file({"t": table}, str(tmp_path / "t.safetensors"))
    reader = HostNgramReader(hs, PagedTable.open([(tmp_path / "t.safetensors", "t")], tuple(table.shape)))
    spans = [([2, 2], [5, 9, 2, 7]), ([9, 2], [11, 12]), ([4, 5], [])]
    want = torch.cat([table[hs.rows(torch.tensor(ids), ctx)[0]].reshape(len(ids), -1) for ctx, ids in spans if ids])
    assert torch.equal(reader.rows(spans), want) and reader.taken == 0
    reader.read_ahead(spans)
    assert torch.equal(reader.rows(spans), want) and reader.taken == 2
    reader.read_ahead(spans[1:2])  # one span read ahead, the others read together in the step: in order still
    assert torch.equal(reader.rows(spans), want) and reader.taken == 3
    # a step that cuts a chunk read ahead otherwise: a shorter one takes the rows it needs and leaves the rest for
    # the next step, a longer one takes all of them and reads only what follows; the same rows as plain reads
    plain = HostNgramReader(hs, reader.table)
    chunk = ([2, 2], [5, 9, 2, 7, 8, 4])
    reader.read_ahead([chunk])
    short, rest = ([2, 2], [5, 9, 2]), ([9, 2], [7, 8, 4])  # (the context after 5 9 2: its last two ids)
    assert torch.equal(reader.rows([short]), plain.rows([short])) and reader.taken == 4 and reader.waiting == 1
    assert torch.equal(reader.rows([rest]), plain.rows([rest])) and reader.taken == 5 and reader.waiting == 0
    whole = plain.rows([chunk])
    read = []
    gather = reader.table.gather
    reader.table.gather = lambda rows: (read.append(rows.numel()), gather(rows))[1]
    reader.read_ahead([short])
    assert torch.equal(reader.rows([chunk]), whole) and reader.taken == 6
    assert read == [3 * hs.num_heads, 3 * hs.num_heads]  # (the read ahead, then only the three ids past it)
    for i in range(ngram_reader.READ_AHEAD_SPANS + 3):
        reader.read_ahead([([2, 2], [20 + i])])
    assert reader.waiting == ngram_reader.READ_AHEAD_SPANS


def test_a_synthetic_table_the_temporary_directory_cannot_hold_is_refused(tmp_path, monkeypatch):
    """--ngram-table disk on a synthetic model writes its table first: where the temporary directory lacks the
    room, a one-line refusal (disk), and auto keeps the table in memory for the plan's check to judge."""
    import json
    from collections import namedtuple

    import ft.engine.ranks.rank_state as rank_state
    import ft.tools.synthetic as synthetic
    from ft.engine import LLM
    from ft.errors import ConfigError
    from test_flash_next_engine import TEXT

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"architectures": ["Qwen3_8_FlashNextForConditionalGeneration"],
                               "text_config": {**TEXT, "shared_expert_intermediate_size": 32, "dtype": "bfloat16"}}))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(synthetic.shutil, "disk_usage", lambda path: usage(1 << 30, 1 << 30, 1000))
    opts = dict(device="cpu", dtype="float32", page_size=16, num_tokens=256)
    with pytest.raises(ConfigError, match=r"--ngram-table disk: a synthetic n-gram table of .* does not fit"):
        LLM(model=f"synthetic:{cfg}", ngram_table="disk", **opts)
    monkeypatch.setattr(rank_state, "available_bytes", lambda: (1 << 20, "MemAvailable"))
    with pytest.raises(ConfigError, match=r"host memory: .*n-gram table"):  # auto: the table stays in the plan
        LLM(model=f"synthetic:{cfg}", **opts)


def test_the_prefix_states_in_host_memory_are_in_the_plan_and_as_many_as_fit(demo, monkeypatch, caplog):
    """--prefix-states-on-host: the prefix cache's host states join the host plan ("prefix states", entries x a
    linear-attention slot); where what the host had before loading leaves room for fewer (past the plan and its
    2 GiB margin), the cache keeps as many as fit and says so in one log line."""
    import ft.engine.ranks.rank_state as rank_state
    from ft.engine import LLM
    from ft.memory.host_memory import HOST_MARGIN

    opts = dict(model=str(demo), device="cpu", prefix_states_on_host=True, max_running_requests=6)
    with LLM(**opts) as llm:
        e = llm.engine
        state = e.cache.layout.unit_costs().mamba_slot
        assert e.prefix_cache.host_entries == 6 and e.host_plan.parts["prefix states"] == 6 * state > 0
        assert "prefix states" in e.describe()["host_plan"]["parts"]
        before = e.host_plan.total - 6 * state  # what loading keeps
    monkeypatch.setattr(rank_state, "available_bytes", lambda: (before + HOST_MARGIN + 2 * state + 1, "MemAvailable"))
    with caplog.at_level("WARNING", logger="ft.engine"), LLM(**opts) as llm:
        assert llm.engine.prefix_cache.host_entries == 2 and llm.engine.host_plan.parts["prefix states"] == 2 * state
    assert "prefix cache: 2 of 6 entries keep their linear-attention state in host memory" in caplog.text
