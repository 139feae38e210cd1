"""`plies gateway` as a process: one ready line, sessions over HTTP with the admin token."""

from __future__ import annotations

import signal

import httpx
import openai

from plies.testing import plies_command, serve_process_sync


def test_standalone_gateway_serves_sessions_over_http(policy_server, qwen3_tokenizer_dir, tmp_path):
    cmd = plies_command("gateway", "--sampler", policy_server.url)
    cmd += ["--tokenizer", str(qwen3_tokenizer_dir), "--max-tokens", "6"]
    with serve_process_sync(cmd, log=tmp_path / "gateway.log") as gateway:
        url, admin = gateway.url, gateway.ready["admin_token"]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
        auth = {"authorization": f"Bearer {admin}"}
        with httpx.Client(base_url=url, timeout=60) as http:
            denied = http.post("/sessions", json={"task_id": "t"}, headers={"authorization": "x"})
            assert denied.status_code == 401
            assert denied.json()["error"]["type"] == "authentication_error"
            key = http.post("/sessions", json={"task_id": "t-1"}, headers=auth).json()["key"]
            with openai.OpenAI(base_url=url, api_key=key, max_retries=0) as client:
                reply = client.chat.completions.create(
                    model="any", messages=[{"role": "user", "content": "hello"}]
                )
            assert reply.choices[0].message.role == "assistant"
            finished = http.post(f"/sessions/{key}/finish", json={"reward": 0.5}, headers=auth)
            trajectory = finished.json()
            assert trajectory["task_id"] == "t-1" and trajectory["reward"] == 0.5
            assert len(trajectory["turns"]) == 1
            turn = trajectory["turns"][0]
            assert len(turn["completion_ids"]) == reply.usage.completion_tokens <= 6
            assert len(turn["prompt_ids"]) == reply.usage.prompt_tokens
            again = http.post(f"/sessions/{key}/finish", headers=auth)
            assert again.status_code == 401
            other = http.post("/sessions", headers=auth).json()["key"]
            assert http.delete(f"/sessions/{other}", headers=auth).status_code == 204
            assert http.delete(f"/sessions/{other}", headers=auth).status_code == 401
        gateway.process.send_signal(signal.SIGINT)
        assert gateway.process.wait(timeout=30) == 130
