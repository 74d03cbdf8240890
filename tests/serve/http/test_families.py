"""`python -m jaxpipe.serve --http` on each family's converted checkpoint says what transformers'
`generate` says: greedy text and token ids through the `openai` client, on a prompt longer
than the sliding windows, with the server's default attention (the CPU kernel here; the XLA
ragged path for DeepSeek-V3's latent attention, whose expanded keys are 12 channels wide) and
sliding layers holding only their window's pages. One server per family, all started at once."""

import contextlib
import os
import socket
import subprocess
import sys
import time

import openai
import torch
import transformers

from jaxpipe.training import hf_workdir
from tests import helpers

ROOT = helpers.ROOT
FAMILIES = list(helpers.MODEL_CLASSES)  # the dense families and DeepSeek-V3
# longer than four windows of 5 positions, past the rotary variants' 16-position context
PROMPT = "def main():\n    return 0\n\nfor i in range(10):\n    print(i * i)\n"


def _start(workdir, port):
  return subprocess.Popen(
      [
          sys.executable, "-m", "jaxpipe.serve", "--workdir", workdir, "--http",
          "--port", str(port), "--model_name", "m", "--max_batch", "2", "--num_pages", "40",
          "--max_tokens_per_step", "32", "--token_buckets", "32",
      ],
      cwd=ROOT,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      env={**os.environ, "PYTHONPATH": ROOT, "JAXPIPE_HOST_DEVICES": "1"},
  )  # fmt: skip


def _free_ports(n: int) -> list[int]:
  """n distinct free ports: each socket is held until all are chosen, so that the system cannot
  hand one out twice before the servers bind them (two servers on one port would answer one
  family's request with another's model)."""
  with contextlib.ExitStack() as stack:
    socks = [stack.enter_context(socket.create_server(("127.0.0.1", 0))) for _ in range(n)]
    return [s.getsockname()[1] for s in socks]


def test_greedy_text_is_transformers_generate(tmp_path):
  """Every family in one test, so that their servers start and compile side by side in one
  worker: text, token ids and prompt length as transformers' tokenizer and `generate` give."""
  procs = {}
  with contextlib.ExitStack() as stack:
    ports = _free_ports(len(FAMILIES))
    for i, family in enumerate(FAMILIES):
      src = helpers.write_tiny_model(tmp_path / family, family, seed=i)
      workdir = str(tmp_path / f"{family}_run")
      hf_workdir.hf_to_orbax(src, workdir)
      port = ports[i]
      proc = _start(workdir, port)
      stack.callback(lambda p=proc: (p.terminate(), p.wait(60)))
      procs[family] = (proc, f"http://127.0.0.1:{port}", src, workdir)
    deadline = time.monotonic() + 600
    for family, (proc, url, src, workdir) in procs.items():
      left = deadline - time.monotonic()  # one deadline for every family's server
      helpers.wait_healthy(url, lambda p=proc: p.poll() is None, left, output=proc.stdout.read)
      tok = transformers.AutoTokenizer.from_pretrained(os.path.join(workdir, "hf"))
      model = transformers.AutoModelForCausalLM.from_pretrained(src, attn_implementation="eager")
      ids = tok(PROMPT).input_ids
      assert len(ids) > 20
      with torch.no_grad():
        out = model.eval().generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
      want = out[0, len(ids) :].tolist()
      client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
      r = client.completions.create(model="m", prompt=PROMPT, max_tokens=16, temperature=0)
      (c,) = r.choices
      assert c.token_ids == want, family
      assert c.text == tok.decode(want, skip_special_tokens=True), family
      assert r.usage.prompt_tokens == len(ids), family
