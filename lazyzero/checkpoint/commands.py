"""`lazyzero ckpt ls | verify | export`: look at, check and hand over lazyzero checkpoints.

A lazyzero checkpoint folder is a DeepSpeed checkpoint folder plus, in each tag, a manifest and
per-rank files of lazyzero's own (layout.py). `export` writes the plain DeepSpeed folder that a
user without lazyzero loads with `deepspeed.initialize(...).load_checkpoint` or `zero_to_fp32.py`.

Exit status: 0 all good, 1 a checkpoint is damaged, 2 a bad folder, tag or option on the command line.
"""

from __future__ import annotations

import argparse
import datetime
import errno
import importlib.util
import os
import shutil
import stat
import sys
import tempfile
import time
from pathlib import Path

from lazyzero.checkpoint.folder_layout import (
    LATEST_NAME,
    MANIFEST_NAME,
    UnsafeCheckpointPath,
    check_tag,
    in_tag,
    leftover_dirs,
    open_inside,
    read_latest,
)
from lazyzero.checkpoint.manifest import (
    CheckpointDamagedError,
    CheckpointEntry,
    Manifest,
    find_problems,
    list_checkpoints,
    read_manifest,
    resolve_tag_to_load,
)

DAMAGED = 1
USAGE_ERROR = 2
# DeepSpeed's own save copies these next to the tags (engine._copy_recovery_script); an export does too.
RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")
# Errors of os.link that mean "no hard link here" (another filesystem, or one without links): copy instead.
NO_LINK_ERRNOS = (errno.EXDEV, errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK)
# DeepSpeed 0.19.8's zero_to_fp32 loads these with mmap=True (parse_optim_states).
MEMORY_MAPPED_BY_ZERO_TO_FP32 = "optim_states.pt"


class UsageError(Exception):
    """A folder, tag or option on the command line that cannot be used: exit 2 with this message."""


def add_ckpt_commands(actions: argparse._SubParsersAction) -> None:
    """The `ls`, `verify` and `export` actions under `lazyzero ckpt`."""
    ls = actions.add_parser("ls", help="list the tags of a checkpoint folder, committed or not, and leftovers")
    ls.add_argument("dir", help="the checkpoint folder (--save-dir of the run)")
    ls.set_defaults(func=_usage_errors_exit_2(list_command))

    verify = actions.add_parser("verify", help="check the size and hash of every file against the manifest")
    verify.add_argument("dir", help="the checkpoint folder (--save-dir of the run)")
    verify.add_argument("tag", nargs="?", default=None,
                        help="default: the tag 'latest' names, else the newest committed")
    verify.add_argument("--all", action="store_true", help="verify every tag folder")
    verify.set_defaults(func=_usage_errors_exit_2(verify_command))

    export = actions.add_parser("export", help="write a plain DeepSpeed checkpoint folder (verified first)")
    export.add_argument("dir", help="the checkpoint folder (--save-dir of the run)")
    export.add_argument("tag", nargs="?", default=None,
                        help="default: the tag 'latest' names, else the newest committed")
    export.add_argument("--out", required=True, help="new (or empty) folder; files are hard links where possible, so "
                        "do not modify them in place")
    export.add_argument("--fp32", metavar="FILE", default=None,
                        help="also write one consolidated fp32 state dict (torch.save) with DeepSpeed's zero_to_fp32")
    export.set_defaults(func=_usage_errors_exit_2(export_command))


def _usage_errors_exit_2(command):
    """`command`, with a UsageError turned into its message on stderr and exit status 2."""
    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except (UsageError, UnsafeCheckpointPath) as err:
            print(f"lazyzero ckpt {args.action}: {err}", file=sys.stderr)
            return USAGE_ERROR
    return run


def list_command(args: argparse.Namespace) -> int:
    root = _checkpoint_folder(args.dir)
    entries = list_checkpoints(root)
    try:
        latest, refused = read_latest(root), None
    except UnsafeCheckpointPath as err:  # still list the tags, then exit 2 naming 'latest'
        latest, refused = None, err
    if entries:
        rows = [("TAG", "STEP", "SIZE", "FILES", "COMMITTED", "STATUS")] + [_table_row(e, latest) for e in entries]
        print(_aligned(rows))
    else:
        print(f"{root}: no checkpoint folders")
    for leftover in leftover_dirs(root):
        print(f"{leftover.name}/: leftover, removed at next start")
    if refused is not None:
        raise refused
    try:
        _, why = resolve_tag_to_load(root)
    except CheckpointDamagedError as err:  # 'latest' names a damaged tag: a resume stops there
        why = str(err)
    if why:
        print(f"warning: {why}")
    return 0


def _table_row(entry: CheckpointEntry, latest: str | None) -> tuple[str, ...]:
    status = _status(entry) + ("  <- latest" if entry.tag == latest else "")
    if entry.path.is_symlink():  # never followed, not even to count its files
        return entry.tag, "-", "-", "-", "-", status
    if entry.manifest is None:
        on_disk = [p.stat().st_size for p in entry.path.rglob("*") if not p.is_symlink() and p.is_file()]
        return entry.tag, "-", human_bytes(sum(on_disk)), str(len(on_disk)), "-", status
    manifest = entry.manifest
    committed_at = datetime.datetime.fromtimestamp(manifest.created_unix).isoformat(timespec="seconds")
    return (entry.tag, str(manifest.global_steps), human_bytes(manifest.total_bytes), str(len(manifest.files)),
            committed_at, status)


def _status(entry: CheckpointEntry) -> str:
    if entry.manifest is None:
        problem = entry.problem.replace(str(entry.path / MANIFEST_NAME), MANIFEST_NAME)
        if entry.damaged:
            return "DAMAGED: " + problem.removeprefix(f"{entry.path}: ")
        return "NOT COMMITTED: " + problem
    # Sizes and names only (a stat per file): hashing every tag would make `ls` as slow as `verify`.
    problems = find_problems(entry.path, entry.manifest, check_hashes=False)
    if problems:
        return f"committed, DAMAGED: {len(problems)} problem(s); see `lazyzero ckpt verify`"
    return "committed"


def verify_command(args: argparse.Namespace) -> int:
    root = _checkpoint_folder(args.dir)
    if args.all and args.tag is not None:
        raise UsageError(f"give a TAG ({args.tag!r}) or --all, not both")
    if args.all:
        tags = [entry.tag for entry in list_checkpoints(root)]
        if not tags:
            raise UsageError(f"{root}: no checkpoint folders to verify")
    else:
        tags = [_pick_tag(root, args.tag)]
    damaged = [tag for tag in tags if not _verify_and_report(root / tag)]
    return DAMAGED if damaged else 0


def _verify_and_report(tag_dir: Path) -> bool:
    """Verify one tag, print OK or every problem; True when it is intact."""
    started = time.perf_counter()
    problems, manifest = check_checkpoint(tag_dir)
    if problems:
        print(f"{tag_dir.name}: DAMAGED ({len(problems)} problem(s)):")
        for problem in problems:
            print(f"  {problem}")
        return False
    print(f"{tag_dir.name}: OK, {len(manifest.files)} files, {manifest.total_bytes:,} bytes "
          f"({human_bytes(manifest.total_bytes)}) verified in {time.perf_counter() - started:.2f} s")
    return True


def check_checkpoint(tag_dir: Path) -> tuple[list[str], Manifest | None]:
    """(problems, manifest) of one tag folder, hashing its files under a progress bar over bytes."""
    from tqdm import tqdm

    try:
        manifest = read_manifest(tag_dir)
    except (CheckpointDamagedError, UnsafeCheckpointPath) as err:
        return [str(err)], None
    with tqdm(total=manifest.total_bytes, unit="B", unit_scale=True, desc=f"verify {tag_dir.name}",
              disable=None, leave=False) as bar:
        return find_problems(tag_dir, manifest, on_bytes=bar.update), manifest


def export_command(args: argparse.Namespace) -> int:
    root = _checkpoint_folder(args.dir)
    out = Path(args.out)
    fp32_file = Path(args.fp32) if args.fp32 else None
    _check_export_targets(root, out, fp32_file)
    tag = _pick_tag(root, args.tag)
    if not _verify_and_report(root / tag):
        print(f"not exporting {tag}: it is damaged", file=sys.stderr)
        return DAMAGED
    refusal = _why_not_loadable_without_code(root / tag) if fp32_file is not None else None
    if refusal is not None:
        print(f"not exporting {tag}: {refusal}", file=sys.stderr)
        return DAMAGED
    linked, copied = write_deepspeed_folder(root / tag, out)
    print(f"exported {tag} to {out}: {linked} file(s) hard-linked, {copied} copied")
    if fp32_file is not None:
        consolidate_fp32(out, tag, fp32_file)
        print(f"wrote the fp32 state dict of {tag} to {fp32_file}")
    return 0


def _check_export_targets(root: Path, out: Path, fp32_file: Path | None) -> None:
    """Refuse before writing anything: an OUT with content, an OUT inside the checkpoint folder
    (it would show up there as a tag), an existing --fp32 file."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"--out {out}: exists and is not an empty folder; refusing to overwrite it")
    if out.resolve().is_relative_to(root.resolve()):
        raise UsageError(f"--out {out}: inside the checkpoint folder {root}; choose a folder outside it")
    if fp32_file is not None and fp32_file.exists():
        raise UsageError(f"--fp32 {fp32_file}: exists; refusing to overwrite it")


def write_deepspeed_folder(tag_dir: Path, out: Path) -> tuple[int, int]:
    """OUT/<tag>/ with DeepSpeed's files of `tag_dir` (not lazyzero's manifest or per-rank files),
    OUT/latest and DeepSpeed's recovery scripts. Returns (files hard-linked, files copied)."""
    from lazyzero.checkpoint.rank_state import rank_state_path

    manifest = read_manifest(tag_dir)
    lazyzero_files = {MANIFEST_NAME} | {rank_state_path(tag_dir, r).name for r in range(manifest.world_size)}
    linked = copied = 0
    for relpath in sorted(manifest.files):
        if relpath in lazyzero_files:
            continue
        target = out / tag_dir.name / relpath
        target.parent.mkdir(parents=True, exist_ok=True)
        if link_or_copy(tag_dir, relpath, target):
            linked += 1
        else:
            copied += 1
    (out / LATEST_NAME).write_text(tag_dir.name)
    _copy_recovery_scripts(out)
    return linked, copied


def link_or_copy(tag_dir: Path, relpath: str, target: Path) -> bool:
    """Hard-link `target` to the file `relpath` of `tag_dir` (no bytes copied); copy where links are
    impossible. True if linked. The file is opened without following links (folder_layout.open_inside)
    and the link must end up on that very file: a file swapped for a link after the verification is
    refused (UnsafeCheckpointPath), not linked or copied."""
    source = tag_dir / relpath
    with os.fdopen(open_inside(*in_tag(tag_dir, relpath)), "rb") as opened:
        expected = os.fstat(opened.fileno())
        try:
            os.link(source, target, follow_symlinks=False)
        except OSError as err:
            if err.errno not in NO_LINK_ERRNOS:
                raise
            with open(target, "xb") as copy:
                shutil.copyfileobj(opened, copy, 8 << 20)
            os.utime(target, ns=(expected.st_atime_ns, expected.st_mtime_ns))
            return False
    found = os.lstat(target)
    if (found.st_dev, found.st_ino) != (expected.st_dev, expected.st_ino):
        target.unlink()
        raise UnsafeCheckpointPath(f"{source}: replaced while it was exported; not linking what is there now")
    return True


def _copy_recovery_scripts(out: Path) -> None:
    # Found without importing deepspeed, which takes seconds and probes for accelerators.
    utils = Path(importlib.util.find_spec("deepspeed").origin).parent / "utils"
    for script in RECOVERY_SCRIPTS:
        if (utils / script).is_file():
            shutil.copyfile(utils / script, out / script)
            (out / script).chmod((out / script).stat().st_mode | stat.S_IXUSR)


def consolidate_fp32(deepspeed_dir: Path, tag: str, fp32_file: Path) -> None:
    """One fp32 state dict file from the DeepSpeed folder, by DeepSpeed's own zero_to_fp32."""
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    fp32_file.parent.mkdir(parents=True, exist_ok=True)
    # DeepSpeed 0.19.8 writes into a folder; with max_shard_size=None it writes exactly one file,
    # pytorch_model.bin (safe_serialization=False), which is then renamed to the name asked for.
    with tempfile.TemporaryDirectory(dir=fp32_file.parent, prefix=".lazyzero-fp32.") as work:
        convert_zero_checkpoint_to_fp32_state_dict(str(deepspeed_dir), work, max_shard_size=None, tag=tag)
        os.replace(Path(work) / "pytorch_model.bin", fp32_file)


def _checkpoint_folder(path: str) -> Path:
    root = Path(path)
    if not root.exists():
        raise UsageError(f"{root}: no such folder")
    if not root.is_dir():
        raise UsageError(f"{root}: not a folder")
    return root


def _pick_tag(root: Path, tag: str | None) -> str:
    """The tag asked for (it must exist), else the one a resume would load."""
    if tag is None:
        try:
            tag, why = resolve_tag_to_load(root)
        except CheckpointDamagedError:
            return read_latest(root)  # damaged: the tag to report (verify) or to refuse (export), not an older one
        if tag is None:
            raise UsageError(why)
        if why:
            print(f"warning: {why}")
        return tag
    try:
        check_tag(tag)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if not (root / tag).is_symlink() and not (root / tag).is_dir():
        existing = ", ".join(entry.tag for entry in list_checkpoints(root)) or "none"
        raise UsageError(f"no tag {tag!r} in {root}; tags there: {existing}")
    return tag


def human_bytes(count: float) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    power = 0
    while count >= 1024 and power < len(units) - 1:
        count, power = count / 1024, power + 1
    return f"{int(count)} B" if power == 0 else f"{count:.1f} {units[power]}"


def _aligned(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def _why_not_loadable_without_code(tag_dir: Path) -> str | None:
    """zero_to_fp32 unpickles every file with weights_only=False: each torch file the (verified)
    manifest lists is first loaded the safe way (memory-mapped, so no bytes are copied), and one that
    would run code stops the export (the refusal names it). zero_to_fp32 memory-maps the optimizer
    files, which torch refuses for its legacy format: such a file stops the export too."""
    # torch, imported here to keep it off `lazyzero --help` (docs/architecture.md).
    from lazyzero.safe_load import UnreadableCheckpointFile, UnsafeCheckpointFile, is_zip_format, load_checkpoint_file

    for relpath in sorted(read_manifest(tag_dir).files):
        path = tag_dir / relpath
        if relpath.endswith(MEMORY_MAPPED_BY_ZERO_TO_FP32) and not is_zip_format(path):
            return (f"{path}: in torch's legacy (non-zip) format, which DeepSpeed's zero_to_fp32 memory-maps and torch "
                    "cannot; load it and save it again with torch.save's default format to export its fp32 weights")
        if relpath.endswith(".pt"):
            try:
                load_checkpoint_file(path, "cpu", mmap=True)
            except (UnsafeCheckpointFile, UnreadableCheckpointFile) as refusal:
                return str(refusal)
    return None
