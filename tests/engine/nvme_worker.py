"""Train the tiny model with ds_configs/cpu_zero3_nvme.json (nvme_path moved to OUT/nvme) and record
which swap files exist on disk while training runs.

Usage (under a launcher): nvme_worker.py OUT
"""

import json
from pathlib import Path

import torch

import lazyzero
from lazyzero.models import build_model
from lazyzero.testing import destroy_engine, worker_args, write_json_from_every_rank

ROOT = Path(__file__).resolve().parents[2]


def wide_model_config(out: Path) -> Path:
    """A one-layer Llama with matrices wide enough that each rank's share is at least 1 MiB in bf16:
    DeepSpeed swaps only tensors of at least max(1 MiB, aio block_size) to NVMe."""
    config = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 1,
              "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 300, "max_position_embeddings": 64}
    path = out / "wide_llama.json"
    write_json_from_every_rank(path, config)
    return path


def main() -> None:
    out = Path(worker_args()[0])
    config = json.loads((ROOT / "ds_configs" / "cpu_zero3_nvme.json").read_text())
    nvme = out / "nvme"
    for section in ("offload_param", "offload_optimizer"):
        config["zero_optimization"][section]["nvme_path"] = str(nvme)
    config["train_micro_batch_size_per_gpu"] = 2
    model = build_model(str(wide_model_config(out)), seed=3)
    engine, _, _, _ = lazyzero.initialize(model=model, model_parameters=model.parameters(), config=config)
    generator = torch.Generator().manual_seed(engine.global_rank)
    losses, files = [], {}
    for _ in range(3):
        ids = torch.randint(0, 300, (2, 16), generator=generator)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        files = {str(p.relative_to(nvme)): p.stat().st_size for p in nvme.rglob("*") if p.is_file()}
    record = {"losses": losses, "files_during_run": files,
              "param_dtype": str(next(engine.module.parameters()).dtype)}
    (out / f"rank{engine.global_rank}.json").write_text(json.dumps(record))
    destroy_engine(engine)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
