#!/usr/bin/env python3
"""Replays one seed of the DLRM reference with fusekit: the reference's initial weights and training
order for `--numpy-rand-seed N`, so that fusekit trains the same model on the same batches and the
two test AUCs differ only by the implementations' arithmetic.

    scripts/reference-replay.py --work DIR --reference DLRM_CHECKOUT --seed N [--fusekit BIN] [--device cpu|cuda]

DIR is a work folder of scripts/compare-reference.sh: fusekit's preprocessed data
(fusekit_processed/, or shards/) of the file both programs read. The reference's ids are its
dictionaries' (data_utils.py): each value's rank of first appearance in the file, which the script
computes from fusekit's ids (checked against the reference's own kaggleAdDisplayChallenge_processed.npz
when DIR holds it). The reference's own code (imported from the checkout, never copied) makes the
random draws in the order dlrm_s_pytorch.py makes them for the Kaggle recipe: the training split's
permutation, the test split's (drawn and unused), then the model. The script writes
DIR/replay_seedN/: fusekit's day files with days 0-5 holding the training records in the reference's
order (day 6 unchanged), and init.ckpt, a fusekit checkpoint at step 0 of those weights (each
fusekit id's table row is the row of the same value's reference id; the unknown rows are zero).
Then it trains fusekit from them in file order (--data-randomize none, --load-model init.ckpt) and
prints the test AUC. Needs numpy and torch; the modules the reference imports but its model does not
use (scikit-learn, tensorboard, tqdm) are replaced by empty ones where they are not installed.
"""
import argparse
import importlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import types
import zlib

import numpy as np

RECIPE = ["--arch-sparse-feature-size=16", "--arch-mlp-bot=13-512-256-64-16", "--arch-mlp-top=512-256-1",
          "--learning-rate=0.1", "--mini-batch-size=128", "--test-mini-batch-size=16384", "--print-every=0",
          "--data-set=kaggle", "--data-randomize=none"]
RECORD_INTS = 40  # label, 13 dense, 26 ids
BLOCK = 4096      # records per checksummed block of the binary format


def crc(data, start=0):
    return zlib.crc32(data, start) & 0xFFFFFFFF


def write_checkpoint(path, config, arrays):
    """A fusekit checkpoint (apps/checkpoint.hpp, FKCKPT02) at step 0 holding the DLRM state
    (Dlrm::save_state: FKDLRMS1, no optimizer state, the arrays in order)."""
    cfg = json.dumps(config, separators=(",", ":")).encode()
    step, length = struct.pack("<Q", 0), struct.pack("<Q", len(cfg))
    head_crc = crc(cfg, crc(length, crc(step)))
    body = bytearray(b"FKDLRMS1" + bytes([0]) + struct.pack("<Q", len(arrays)))
    for a in arrays:
        a = np.ascontiguousarray(a, dtype=np.float32).ravel()
        body += struct.pack("<Q", a.size) + a.tobytes()
    body = bytes(body)
    with open(path, "wb") as f:
        f.write(b"FKCKPT02" + step + length + cfg + struct.pack("<I", head_crc) + body +
                struct.pack("<Q", len(body)) + struct.pack("<I", crc(body)) + b"FKCKEND2")


def write_day(path, header, records):
    """A binary day file in version 3 (ids, CRC-32 checksums; docs/dlrm.md): the original header
    (version 3 or 4) as version 3, the records, the table of each block's CRC-32 and its own."""
    header = bytearray(header)
    header[8:12] = struct.pack("<I", 3)
    header[60:64] = struct.pack("<I", crc(bytes(header[:60])))
    header = bytes(header)
    data = records.tobytes()
    size = RECORD_INTS * 4
    blocks = [crc(data[k * size:min(len(records), k + BLOCK) * size]) for k in range(0, len(records), BLOCK)]
    table = np.array(blocks, dtype=np.uint32).tobytes()
    with open(path, "wb") as f:
        f.write(header + data + table + struct.pack("<I", crc(table)))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", required=True)
    p.add_argument("--reference", required=True, help="a facebookresearch/dlrm checkout")
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--fusekit", default="build/fusekit")
    p.add_argument("--device", default="cpu")
    p.add_argument("--prepare-only", action="store_true", help="write replay_seedN/ and stop")
    args = p.parse_args()
    work = args.work
    shards = next((os.path.join(work, d) for d in ("fusekit_processed", "shards")
                   if os.path.isfile(os.path.join(work, d, "manifest.json"))), None)
    if shards is None:
        sys.exit(f"reference-replay: {work} holds no fusekit_processed/ (or shards/)")
    sys.path.insert(0, args.reference)
    import torch
    for name, attrs in (("sklearn", {}), ("sklearn.metrics", {}), ("tqdm", {"tqdm": lambda x, *a, **k: x}),
                        ("torch.utils.tensorboard", {"SummaryWriter": object})):
        try:
            importlib.import_module(name)
        except ImportError:
            stub = types.ModuleType(name)
            stub.__dict__.update(attrs)
            sys.modules[name] = stub
    import dlrm_s_pytorch as reference  # the reference's own model code

    manifest = json.load(open(os.path.join(shards, "manifest.json")))
    days = manifest["days"]
    raw = [np.fromfile(os.path.join(shards, d["file"]), dtype=np.uint8) for d in days]
    records = np.concatenate([r[64:64 + d["records"] * RECORD_INTS * 4].view(np.int32).reshape(-1, RECORD_INTS)
                              for r, d in zip(raw, days)])
    ids = records[:, 14:].astype(np.int64)
    rows = manifest["vocabulary"]["table_rows"]
    ref_of = []  # per feature: fusekit id -> the reference's id (first appearance), -1 when unseen
    for t in range(len(rows)):
        seen, first = np.unique(ids[:, t], return_index=True)
        to_ref = np.full(rows[t], -1, dtype=np.int64)
        to_ref[seen[np.argsort(first, kind="stable")]] = np.arange(len(seen))
        ref_of.append(to_ref)
    counts = np.array([int((r >= 0).sum()) for r in ref_of])
    npz = os.path.join(work, "kaggleAdDisplayChallenge_processed.npz")
    if os.path.isfile(npz):
        z = np.load(npz)
        if not np.array_equal(z["counts"], counts) or not all(
                np.array_equal(ref_of[t][ids[:, t]], z["X_cat"][:, t]) for t in range(len(rows))):
            sys.exit(f"reference-replay: {npz} does not give each value its first appearance's rank")
    n_train = sum(d["records"] for d in days[:-1])

    # The reference's draws, in its order (dlrm_s_pytorch.py main: seeds, the two splits' datasets,
    # then the model).
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    order = np.random.permutation(np.arange(n_train))
    np.random.permutation(np.arange(n_train))
    ln_bot, ln_top = np.array([13, 512, 256, 64, 16]), np.array([367, 512, 256, 1])
    model = reference.DLRM_Net(16, counts, ln_bot, ln_top, arch_interaction_op="dot",
                               arch_interaction_itself=False, sigmoid_bot=-1, sigmoid_top=ln_top.size - 2,
                               loss_threshold=0.0, ndevices=-1, loss_function="bce")
    arrays = []
    for layer in list(model.bot_l) + list(model.top_l):
        if isinstance(layer, torch.nn.Linear):
            arrays += [layer.weight.detach().numpy(), layer.bias.detach().numpy()]
    for t in range(len(rows)):
        table = model.emb_l[t].weight.detach().numpy()[np.maximum(ref_of[t], 0)].copy()
        table[ref_of[t] < 0] = 0  # fusekit's unknown id: no value of this file
        arrays.append(table)

    out = os.path.join(work, f"replay_seed{args.seed}")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    shutil.copy(os.path.join(shards, "manifest.json"), out)
    shutil.copy(os.path.join(shards, manifest["vocabulary"]["file"]), out)
    train = records[:n_train][order]
    at = 0
    for d, r in zip(days[:-1], raw):
        write_day(os.path.join(out, d["file"]), r[:64].tobytes(), np.ascontiguousarray(train[at:at + d["records"]]))
        at += d["records"]
    shutil.copy(os.path.join(shards, days[-1]["file"]), out)

    flags = RECIPE + [f"--data={out}", f"--device={args.device}",
                      "--impl=" + ("fused" if args.device.startswith("cuda") else "reference")]
    dry = subprocess.run([args.fusekit, "train", *flags, "--dry-run"], check=True, capture_output=True, text=True).stdout
    config = json.loads(dry[dry.index("\n{") + 1:])
    write_checkpoint(os.path.join(out, "init.ckpt"), config, arrays)
    if args.prepare_only:
        return
    run = subprocess.run([args.fusekit, "train", *flags, "--load-model", os.path.join(out, "init.ckpt")],
                         check=True, capture_output=True, text=True).stdout
    summary = re.search(r"test logloss [0-9.]+, AUC [0-9.]+, accuracy [0-9.]+", run)
    print(f"fusekit {args.device}, the reference's seed {args.seed} replayed: {summary.group(0) if summary else run}")


if __name__ == "__main__":
    main()
