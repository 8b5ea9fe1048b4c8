"""A Hugging Face model and dataset in a real swarm: 3 peers train a tiny transformers Llama, built from a
config.json with a seeded init, on a parquet dataset tokenized by a BPE tokenizer; every outer step is
bit-identical on all peers (invariant 1) and the held-out loss falls. The default peer never imports the
Hugging Face libraries."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from p2p_diloco.observe.report import check_invariant_1

from .harness import local_swarm

pytestmark = pytest.mark.integration

_WORDS = "the cat sat on a mat and dog ran far away while birds sang softly over green hills".split()
ROUNDS_OF_THREE = 2  # outer steps that every peer averages in the group of all three


def _write_inputs(folder: Path) -> list[str]:
    """A parquet file of generated documents, a BPE tokenizer trained on them, and a Llama config.json whose
    vocabulary is the tokenizer's: the flags that make a peer use them."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    rng = random.Random(0)
    texts = [" ".join(rng.choice(_WORDS) for _ in range(rng.randrange(8, 40))) for _ in range(3000)]
    pq.write_table(pa.table({"text": texts}), folder / "train.parquet")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=320, initial_alphabet=alphabet, show_progress=False))
    tokenizer.save(str(folder / "tokenizer.json"))
    llama = dict(model_type="llama", vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    (folder / "config.json").write_text(json.dumps(llama))
    return [
        "--model-config", str(folder / "config.json"), "--dataset", str(folder / "train.parquet"),
        "--tokenizer", str(folder / "tokenizer.json"), "--data-cache-dir", str(folder / "cache"),
        "--seq-len", "64", "--batch-size", "8",
    ]


def _averaged_in_three(records: list[dict]) -> int:
    return sum(r["status"] == "ok" and r["group_size"] == 3 for r in records)


@pytest.mark.timeout(240)
def test_three_peers_train_a_transformers_llama_on_parquet(tmp_path, reaper, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # whatever the libraries cache stays in the test
    swarm = local_swarm(tmp_path / "run", reaper, _write_inputs(tmp_path), built_in_model=False)
    for index in range(3):
        # all three begin together: a peer that starts seconds early (tens of seconds of imports on a busy machine)
        # trains alone and is outvoted back to the start by the other two (docs/design.md §4)
        swarm.start(f"peer{index}", shard=index, num_shards=3, extra=["--wait-for-peers", "3"])
    swarm.wait_until(lambda: all(_averaged_in_three(swarm.records(n)) >= ROUNDS_OF_THREE for n in swarm.peers), 180,
                     f"{ROUNDS_OF_THREE} rounds averaged by all three peers")
    assert all(code == 0 for code in swarm.stop_all().values()), swarm.log_tails()

    records = swarm.all_records()
    initial_shas = {records[name][0]["global_sha256"] for name in records}
    assert len(initial_shas) == 1, initial_shas  # the same seeded init on every peer
    invariant = check_invariant_1(records)
    assert invariant["held"], invariant["forks"]
    assert invariant["outer_steps_reported_by_several_peers"] >= ROUNDS_OF_THREE + 1
    # the held-out documents are the same on every peer: the same global params give the same loss
    last = min(records[name][-1]["outer_step"] for name in records)
    assert len({r["eval_loss"] for peer in records.values() for r in peer if r["outer_step"] == last and r["status"] == "ok"}) == 1
    evaluated = [r for r in records["peer0"] if r.get("eval_loss") is not None]  # a failed last round has no eval
    initial, final = evaluated[0]["eval_loss"], evaluated[-1]["eval_loss"]
    steps = evaluated[-1]["outer_step"]
    print(f"held-out loss of peer0's global params: {initial:.3f} -> {final:.3f} after {steps} outer steps")
    assert final < initial - 1.0, (initial, final)


def test_the_default_peer_does_not_import_the_hugging_face_libraries():
    """Default flags: the config, the byte corpus, the model, the learner and the swarm modules a peer imports."""
    code = """
import sys
from p2p_diloco.cli.flags import OneLineParser, add_peer_flags, resolve_config
from p2p_diloco.cli.peer import open_process_inputs
from p2p_diloco.train.learner import Learner
import p2p_diloco.swarm.swarm_link
parser = OneLineParser()
add_peer_flags(parser)
config = resolve_config(parser.parse_args([]))
dataset, metrics = open_process_inputs(config)
Learner(config, dataset, metrics)
print(sorted(m for m in ("transformers", "datasets", "tokenizers", "pyarrow", "huggingface_hub") if m in sys.modules))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout
