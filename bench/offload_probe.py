"""Raw figures of llama-server with part of a model in host memory: the data issue 27's memory
model and twin are checked against (layers on the GPU with -ngl, experts on the CPU with
--n-cpu-moe, the micro-batch, and llama.cpp's own --fit choice).

For each configuration: one launch at -lv 4, the buffers llama.cpp logs per device (model, KV,
compute, output), NVML's figure for the server process, and a few single-stream requests
(prompt tok/s and decode tok/s from the server's own timings). One JSON line per launch:

    python3 bench/offload_probe.py MODEL.gguf --server BIN --case "ngl=14 ub=512" ... --out F.jsonl

A case is space-separated key=value: ngl (-ngl), ncmoe (--n-cpu-moe), ub (-ub), b (-b), fit
("on": no -ngl, llama.cpp chooses; otherwise --fit off), ctx (per slot), np (slots).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

BUFFER = re.compile(r"(\S+) (model|KV|compute|output|RS) buffer size =\s+([\d.]+) MiB")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def nvml_process_mib(pid: int) -> float | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
            if p.pid == pid and p.usedGpuMemory is not None:
                return p.usedGpuMemory / 2**20
        return 0.0
    except Exception as e:  # noqa: BLE001 - no NVML (a CPU run): the figure is absent
        print(f"nvml: {e}", file=sys.stderr)
        return None


def argv_for(server: str, model: str, case: dict[str, str], port: int) -> list[str]:
    ctx, n = int(case.get("ctx", 4096)), int(case.get("np", 1))
    argv = [
        server,
        "-m",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-c",
        str(ctx * n),
        "-np",
        str(n),
        "-lv",
        "4",
        "-fa",
        "on",
    ]
    if case.get("fit") == "on":
        argv += ["--fit", "on"]
    else:
        argv += ["--fit", "off", "-ngl", case.get("ngl", "999")]
    for key, flag in (("ncmoe", "--n-cpu-moe"), ("ub", "-ub"), ("b", "-b"), ("t", "-t")):
        if key in case:
            argv += [flag, case[key]]
    return argv


def probe(server: str, model: str, case: dict[str, str], prompt: int, output: int, repeats: int, log_dir: str) -> dict:
    port = free_port()
    argv = argv_for(server, model, case, port)
    tag = "_".join(f"{k}{v}" for k, v in case.items())
    log_path = os.path.join(log_dir, f"{os.path.basename(model)}_{tag}.log")
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    row: dict = {"model": os.path.basename(model), "case": case, "argv": argv[1:]}
    try:
        base = f"http://127.0.0.1:{port}"
        while True:
            if proc.poll() is not None:
                row["error"] = f"exited {proc.returncode}"
                break
            if time.monotonic() - t0 > 180:
                row["error"] = "not healthy after 180 s"
                break
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        if "error" not in row:
            row["load_s"] = round(time.monotonic() - t0, 2)
            runs = []
            words = " ".join(f"w{i % 97}" for i in range(prompt))
            for i in range(repeats + 1):  # the first warms up
                reply = post(
                    base + "/completion",
                    {"prompt": f"{i} {words}", "n_predict": output, "ignore_eos": True, "cache_prompt": False},
                    timeout=600,
                )
                if i:
                    t = reply["timings"]
                    runs.append(
                        {
                            "prompt_n": t["prompt_n"],
                            "prompt_tok_s": t["prompt_per_second"],
                            "predicted_n": t["predicted_n"],
                            "decode_tok_s": t["predicted_per_second"],
                        }
                    )
            row["runs"] = runs
            row["nvml_process_mib"] = nvml_process_mib(proc.pid)
    except Exception as e:  # noqa: BLE001 - one bad case must not lose the others
        row["error"] = repr(e)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    text = open(log_path, encoding="utf-8", errors="replace").read()
    buffers: dict[str, float] = {}
    for dev, kind, mib in BUFFER.findall(text):
        buffers[f"{dev} {kind}"] = buffers.get(f"{dev} {kind}", 0.0) + float(mib)
    row["buffers_mib"] = buffers
    row["fit_log"] = [
        line.split(": ", 1)[-1]
        for line in text.splitlines()
        if "common_params_fit" in line or "common_fit_params" in line
    ][:20]
    row["log"] = log_path
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--server", required=True)
    ap.add_argument("--case", action="append", required=True)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    log_dir = os.path.dirname(os.path.abspath(args.out))
    with open(args.out, "a") as out:
        for spec in args.case:
            case = dict(kv.split("=", 1) for kv in spec.split())
            row = probe(args.server, args.model, case, args.prompt, args.output, args.repeats, log_dir)
            out.write(json.dumps(row) + "\n")
            out.flush()
            runs = row.get("runs") or []
            dec = [r["decode_tok_s"] for r in runs]
            print(
                f"{spec:32s} {row.get('error', '')} load {row.get('load_s')} s decode "
                f"{[round(d, 1) for d in dec]} nvml {row.get('nvml_process_mib')} buffers {row['buffers_mib']}",
                flush=True,
            )


if __name__ == "__main__":
    main()
