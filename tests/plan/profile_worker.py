"""Every rank profiles the tiny model at once; each writes the profile it obtained to OUT/rank{r}.json.

Usage (under the deepspeed launcher, 2 ranks): profile_worker.py OUT [NVME_FOLDER]
The cache file is OUT/profile.json (written by rank 0); a second call must reuse it on every rank.
"""

from pathlib import Path

import deepspeed
import torch.distributed as dist

from lazyzero.models import build_model
from lazyzero.plan.profile.profiler import ProfileSettings, load_or_profile
from lazyzero.testing import worker_args

SETTINGS = ProfileSettings(repeats=2, warmup=1, optimizer_elements=1 << 16, host_copy_bytes=4 << 20,
                           nvme_bytes=4 << 20)


def main() -> None:
    args = worker_args()
    out, nvme = Path(args[0]), (args[1] if len(args) > 1 else None)
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    model = build_model("tiny", seed=1, vocab_size=300)
    shape = dict(micro_batch=2, seq_len=32, nvme_path=nvme, settings=SETTINGS, progress=False)
    first = load_or_profile(out / "profile.json", model, **shape)
    messages = []
    again = load_or_profile(out / "profile.json", model, log=messages.append, **shape)
    (out / f"rank{rank}.json").write_text(first.to_json())
    (out / f"rank{rank}_reused.txt").write_text(f"{again == first} {messages}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
