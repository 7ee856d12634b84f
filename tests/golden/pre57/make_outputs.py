#!/usr/bin/env python3
"""Makes the reference outputs of tests/dist/pre57_outputs_test.cpp.

Usage: make_outputs.py DIFFTRAIN_PROGRAM

Run it with a difftrain program built from main at 81f9702 (before issue 57's family seam):
  git worktree add /tmp/old57 81f9702 && (cd /tmp/old57 && BUILD_TARGETS=difftrain-cli bash scripts/build)
  tests/golden/pre57/make_outputs.py /tmp/old57/build/bin/difftrain
It writes data/ (four captioned 40x36 PNGs, made here with zlib; kept when present), runs every
command of commands.json in a fresh folder, and copies each command's output safetensors to
outputs/<name>.safetensors, a training run's losses (metrics.jsonl) to outputs/<name>.losses.json,
and the CPU and LibTorch lines of `difftrain env` to outputs/machine.txt.
"""
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.dirname(HERE)


def png(path, width, height, pixel):
    rows = b"".join(b"\0" + b"".join(bytes(pixel(x, y)) for x in range(width))
                    for y in range(height))

    def chunk(kind, data):
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n")
        f.write(chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)))
        f.write(chunk(b"IDAT", zlib.compress(rows, 9)))
        f.write(chunk(b"IEND", b""))


def make_data(data):
    if os.path.isdir(data):
        return
    os.makedirs(data)
    colours = [("red", (220, 30, 40)), ("green", (30, 200, 60)), ("blue", (40, 60, 210)),
               ("yellow", (230, 210, 30))]
    with open(os.path.join(data, "metadata.jsonl"), "w") as meta:
        for i, (name, rgb) in enumerate(colours):
            def pixel(x, y, i=i, rgb=rgb):
                inside = (x // 10 + y // 9 + i) % 2 == 0
                grey = (x * 5 + y * 3 + 17 * i) % 256
                return rgb if inside else (grey, grey, (grey + 64) % 256)
            file = "img%d.png" % i
            png(os.path.join(data, file), 40, 36, pixel)
            meta.write(json.dumps({"file_name": file, "text": "a %s checkerboard" % name}) + "\n")


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    program = os.path.abspath(sys.argv[1])
    spec = json.load(open(os.path.join(HERE, "commands.json")))
    data = os.path.join(HERE, "data")
    make_data(data)
    out = os.path.join(HERE, "outputs")
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, **spec["env"])
    for command in spec["commands"]:
        work = tempfile.mkdtemp(prefix="pre57_")
        args = [a.replace("${GOLDEN}", GOLDEN).replace("${DATA}", data).replace("${WORK}", work)
                for a in command["args"]]
        print("==", command["name"], flush=True)
        subprocess.run([program] + args, env=env, check=True)
        shutil.copyfile(os.path.join(work, command["output"]),
                        os.path.join(out, command["name"] + ".safetensors"))
        metrics = os.path.join(work, command["output"].split("/")[0], "metrics.jsonl")
        if args[0] == "train":
            losses = [json.loads(line)["loss"] for line in open(metrics)
                      if line.strip() and "loss" in json.loads(line)]
            with open(os.path.join(out, command["name"] + ".losses.json"), "w") as f:
                json.dump(losses, f)
        shutil.rmtree(work)
    env_text = subprocess.run([program, "env"], env=env, capture_output=True, text=True).stdout
    lines = [line[2:] for line in env_text.splitlines()
             if line.startswith("- CPU:") or line.startswith("- LibTorch version:")]
    with open(os.path.join(out, "machine.txt"), "w") as f:
        f.write("\n".join(sorted(lines)) + "\n")


if __name__ == "__main__":
    main()
