"""A plain Lightning script (`Trainer(strategy=DeepSpeedStrategy(config=...))`) with the one line
`lazyzero.patch_deepspeed()` added; run by tests/app/test_lightning.py on 2 CPU ranks
(`deepspeed --num_gpus 2`).

Lightning's DeepSpeedStrategy refuses any accelerator but CUDA in `setup_environment`
(lightning/pytorch/strategies/deepspeed.py, `DeepSpeedStrategy.setup_environment`), before it reaches
DeepSpeed (tests/app/test_lightning.py shows it); this script uses `CpuDeepSpeedStrategy`, the same
strategy without that one check, the nearest path that runs here (docs/trainers.md).

Arguments: OUT_DIR DS_CONFIG [STEPS [resume CKPT_DIR | last]]. An epoch is one batch per rank, the
same in every epoch, and ModelCheckpoint saves every SAVE_EVERY epochs (keeping all: its save_top_k=1
deletes the previous checkpoint while the new one may still be uncommitted). With "last" it also links
`last.ckpt` to the folder it just saved (`save_last="link"`) and `fit` starts from `ckpt_path="last"`
(afresh, with Lightning's warning, when there is none). Resumed from a
checkpoint saved at an epoch's end, Lightning runs one more batch of that epoch from a DataLoader
restarted at its first batch (plain DDP too); with one batch per epoch a resumed run sees what an
uninterrupted one does, so the losses can be compared. Rank 0 writes
OUT_DIR/result.json: the engine's class, the lazyzero metrics and loss of every step, the metrics
after the last commit, the checkpoint folders, the folder `fit` resumed from.
"""

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from torch.utils.data import DataLoader

import lazyzero
from lazyzero.app.data.arithmetic import format_example, generate_problems
from lazyzero.app.data.dataset import TokenizedExamples
from lazyzero.app.data.tokenizer import ByteTokenizer
from lazyzero.models import build_model

STEPS = 4
SAVE_EVERY = 2
RANKS = 2
BATCH = 4


class CpuDeepSpeedStrategy(DeepSpeedStrategy):
    """Lightning's DeepSpeedStrategy without its CUDA-only check. The CPU devices carry the rank as
    index, which Lightning's own device check (`_validate_device_index_selection`) and DeepSpeed's
    engine (`args.device_rank`, compared with 0) expect of GPUs."""

    def __init__(self, **kwargs):
        super().__init__(parallel_devices=[torch.device("cpu", rank) for rank in range(RANKS)], **kwargs)

    def setup_environment(self) -> None:
        # DeepSpeedStrategy's own less its accelerator check: DDPStrategy's starts torch.distributed
        # through DeepSpeedStrategy.setup_distributed, then sets the device up.
        DDPStrategy.setup_environment(self)


class LanguageModel(L.LightningModule):
    def __init__(self, vocab_size: int):
        super().__init__()
        self.model = build_model("tiny", vocab_size=vocab_size, seed=0)

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def configure_optimizers(self):
        return None  # the DeepSpeed config's "optimizer" section: lazyzero's 8-bit AdamW


class RecordSteps(Callback):
    """The engine's lazyzero metrics and the loss after every optimizer step."""

    def __init__(self):
        self.metrics, self.losses = [], []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        engine = trainer.strategy.model
        self.metrics.append({"step": trainer.global_step, **engine.lazyzero_step_metrics()})
        self.losses.append(outputs["loss"].item())


def write_result(out: str, result: dict) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        (Path(out) / "result.json").write_text(json.dumps(result))


def main() -> None:
    out, ds_config, *rest = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    steps = int(rest[0]) if rest else STEPS
    mode = rest[1:]
    lazyzero.patch_deepspeed()  # the one line this script adds to a plain Lightning script

    L.seed_everything(0)
    tokenizer = ByteTokenizer()
    texts = [format_example(problem) for problem in generate_problems(RANKS * BATCH, seed=0, split="train")]
    loader = DataLoader(TokenizedExamples(texts, tokenizer, seq_len=64), batch_size=BATCH, shuffle=False)
    module = LanguageModel(tokenizer.vocab_size)
    recorder = RecordSteps()
    checkpoints = ModelCheckpoint(dirpath=str(Path(out) / "lightning"), save_top_k=-1, every_n_epochs=SAVE_EVERY,
                                  save_last="link" if mode == ["last"] else None)
    trainer = L.Trainer(accelerator="cpu", devices=RANKS, strategy=CpuDeepSpeedStrategy(config=ds_config),
                        max_steps=steps, callbacks=[recorder, checkpoints], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=True)
    ckpt_path = mode[1] if mode[:1] == ["resume"] else "last" if mode == ["last"] else None
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    engine = trainer.strategy.model
    engine.wait_for_checkpoints()
    write_result(out, {"engine_class": type(engine).__name__,
                       "is_lazyzero": isinstance(engine, lazyzero.LazyZeroEngine),
                       "features": engine.lazyzero_config.enabled_features(),
                       "optimizer_class": type(engine.basic_optimizer).__name__,
                       "metrics": recorder.metrics, "losses": recorder.losses,
                       "after_commit": engine.lazyzero_step_metrics(),
                       "checkpoints": sorted(p.name for p in (Path(out) / "lightning").iterdir()),
                       "resumed_from": trainer.ckpt_path and Path(trainer.ckpt_path).name})
    torch.distributed.barrier()
    engine.destroy()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
