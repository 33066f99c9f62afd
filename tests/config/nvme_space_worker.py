"""ZeRO-3 with the optimizer offloaded to an NVMe folder too small for its swap files, on real ranks
(tests/config/test_nvme_space.py). Usage (under the deepspeed launcher): nvme_space_worker.py FOLDER
Prints "trained" if a step ran (it must not)."""

import torch

import lazyzero
from lazyzero.testing import worker_args


def main() -> None:
    [folder] = worker_args()
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1))  # 16,897
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": folder}}}
    engine, _, _, _ = lazyzero.initialize(model=model, model_parameters=model.parameters(), config=config)
    loss = engine(torch.randn(2, 64)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    print("trained", flush=True)


if __name__ == "__main__":
    main()
