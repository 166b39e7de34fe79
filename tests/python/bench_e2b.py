"""The E2B part of `make bench`: the same work through E2B's unmodified SDK and through the
gateway's own API, round by round on one running gateway: a create (`Sandbox.create`
against `POST /api/kernels`, both from the warm pool) and `run_code("1+1")` against the
agent API's `POST /api/kernels/{id}/execute`. The bench binary starts the gateway and
reads the JSON this prints (every sample, in ms).

Usage: bench_e2b.py URL TOKEN ROUNDS RUNS"""

from __future__ import annotations

import json
import sys
import time

import requests
from e2b_code_interpreter import Sandbox


def timed(f) -> float:
    started = time.perf_counter()
    f()
    return (time.perf_counter() - started) * 1000


def main() -> None:
    url, token, rounds, runs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    opts = {"api_url": url, "sandbox_url": url, "api_key": token}
    api = requests.Session()
    api.headers["Authorization"] = f"token {token}"
    samples: dict[str, list[float]] = {
        "sdk_create_ms": [], "api_create_ms": [], "sdk_run_code_ms": [], "api_execute_ms": []}

    def settle() -> None:
        # The warm pool starts a replacement after each take: wait until it is full again.
        for _ in range(600):
            pool = api.get(url + "/readyz", timeout=30).json().get("pool", {})
            if pool.get("ready") == pool.get("target"):
                return
            time.sleep(0.1)

    for _ in range(rounds):
        settle()
        made: list = []
        samples["sdk_create_ms"].append(timed(lambda: made.append(Sandbox.create(**opts))))
        sandbox = made.pop()
        settle()
        samples["api_create_ms"].append(
            timed(lambda: made.append(api.post(url + "/api/kernels", json={}, timeout=120))))
        created = made.pop()
        assert created.status_code == 201, created.text
        kid = created.json()["id"]
        try:
            assert sandbox.run_code("1+1").text == "2"
            execute = lambda: api.post(f"{url}/api/kernels/{kid}/execute", json={"code": "1+1"},
                                       timeout=60).raise_for_status()
            execute()
            for _ in range(runs):
                samples["sdk_run_code_ms"].append(timed(lambda: sandbox.run_code("1+1")))
                samples["api_execute_ms"].append(timed(execute))
        finally:
            sandbox.kill()
            api.delete(f"{url}/api/kernels/{kid}", timeout=60)
    json.dump(samples, sys.stdout)


if __name__ == "__main__":
    main()
