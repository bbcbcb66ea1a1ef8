"""Scripts work like notebooks: `dh.Ranks` and `dh.launch` from a `python script.py` with or
without the `if __name__ == "__main__":` guard either run, or are refused before anything
starts with the guard shown. Each script runs in a subprocess, as a reader would run it."""

import subprocess
import sys
import textwrap

import pytest

WORK = textwrap.dedent("""
    import ddp_helpers as dh


    def work(rank, world_size):
        return rank * 10
""")


def run_script(tmp_path, body: str) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=180)


def test_persistent_ranks_run_from_a_script_without_the_guard(tmp_path):
    p = run_script(tmp_path, """
        import ddp_helpers as dh

        with dh.Ranks(nprocs=2, backend="gloo", timeout=60) as pool:
            pool.run("t = torch.ones(1) * (rank + 1)\\ndist.all_reduce(t)")
            print("values:", [float(t) for t in pool.get("t")])
    """)
    assert p.returncode == 0, p.stderr
    assert "values: [3.0, 3.0]" in p.stdout
    assert "RankDied" not in p.stderr


def test_a_module_function_launches_from_a_script_without_the_guard(tmp_path):
    p = run_script(tmp_path, """
        import ddp_helpers as dh
        from ddp_helpers.lessons import spawning as lesson

        print("results:", dh.launch(lesson.all_reduce_once, args=(2,), nprocs=2, output="none"))
    """)
    assert p.returncode == 0, p.stderr
    assert "results: [3.0, 3.0]" in p.stdout


def test_a_script_function_without_the_guard_is_refused_with_the_guard_shown(tmp_path):
    p = run_script(tmp_path, WORK + "\n\nprint(dh.launch(work, args=(2,), nprocs=2))\n")
    assert p.returncode == 1
    assert "LaunchRefused: fn work is defined in the script script.py" in p.stderr
    assert "The call at line 9 (`print(dh.launch(work, args=(2,), nprocs=2))`)" in p.stderr
    assert '    if __name__ == "__main__":\n        print(dh.launch(' in p.stderr
    assert "Nothing was started." in p.stderr
    assert "os._exit" not in p.stderr and "RankDied" not in p.stderr


def test_a_script_function_under_the_guard_runs_as_under_mp_spawn(tmp_path):
    p = run_script(tmp_path, WORK + textwrap.dedent("""

        if __name__ == "__main__":
            print("results:", dh.launch(work, args=(2,), nprocs=2))
    """))
    assert p.returncode == 0, p.stderr
    assert "results: [0, 10]" in p.stdout


@pytest.mark.parametrize("call", ["dh.launch(lesson.all_reduce_once, args=(cfg,), nprocs=1)",
                                  "with dh.Ranks(1, backend='gloo') as pool: pool.push(cfg=cfg)"])
def test_a_script_class_sent_without_the_guard_is_refused(tmp_path, call):
    p = run_script(tmp_path, f"""
        import ddp_helpers as dh
        from ddp_helpers.lessons import spawning as lesson


        class Config:
            lr = 0.1


        cfg = Config()
        {call}
    """)
    assert p.returncode == 1
    assert "refers to __main__.Config, which is defined in the script script.py" in p.stderr
    assert 'if __name__ == "__main__":' in p.stderr
