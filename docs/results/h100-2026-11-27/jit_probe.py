import os, subprocess, sys, tempfile, time
sys.path.insert(0, "tests")
import test_misses_gpu as t
with tempfile.TemporaryDirectory() as cache:
    script = t.JIT_SCRIPT.format(tests=os.path.abspath("tests"))
    for run in range(2):
        begin = time.time()
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              env={**os.environ, "FMHA_CACHE_DIR": cache})
        print(f"run {run}: exit {done.returncode}, {time.time() - begin:.1f} s")
        print(done.stdout.strip())
        print(done.stderr.strip()[-1500:])
