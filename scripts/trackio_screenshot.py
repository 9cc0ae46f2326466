"""Screenshot trackio's local dashboard of a qerl run, headless (issue 41; not part of CI).

    pip install 'qerl[trackio]' playwright && python -m playwright install chromium
    python scripts/trackio_screenshot.py [--project huggingface] [--out trackio.png] [--train]

--train first runs a 3-step GRPO on a tiny random model with report_to=trackio (TRACKIO_DIR, if set,
is the store both use). The dashboard is trackio's own (`trackio.show`), served on localhost only;
the script waits for it, opens it in headless Chromium and writes a full-page PNG.
Written without a browser at hand: not yet run end to end.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path


def tiny_run(project: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny_models import save_tiny, tiny_tokenizer

    os.environ.setdefault("TRACKIO_PROJECT", project)
    from qerl.trl import GRPOConfig, GRPOTrainer

    folder = Path(tempfile.mkdtemp(prefix="qerl_trackio_"))
    save_tiny(folder / "model", "llama")
    tiny_tokenizer().save_pretrained(folder / "model")
    args = GRPOConfig(output_dir=str(folder / "run"), max_steps=3, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, learning_rate=1e-3, report_to="trackio", save_strategy="no",
                      parity_check_steps=0)
    GRPOTrainer(model=str(folder / "model"), reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
                args=args, train_dataset=[{"prompt": f"{a}+{a}="} for a in range(8)]).train()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--project", default="huggingface")
    ap.add_argument("--out", default="trackio.png")
    ap.add_argument("--train", action="store_true", help="log a tiny 3-step run first")
    a = ap.parse_args()
    if a.train:
        tiny_run(a.project)
    import trackio

    port = free_port()
    threading.Thread(target=trackio.show, kwargs=dict(project=a.project, open_browser=False, block_thread=True,
                                                      host="127.0.0.1", server_port=port), daemon=True).start()
    url = f"http://127.0.0.1:{port}/?project={a.project}"
    for _ in range(120):  # the server's start
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.5)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch()
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(url, wait_until="networkidle", timeout=120_000)
        page.wait_for_timeout(3000)  # the plots draw after the data arrives
        page.screenshot(path=a.out, full_page=True)
        browser.close()
    print(f"wrote {a.out} ({url})")


if __name__ == "__main__":
    main()
