import inspect

import pytest

import lmfs
from lmfs.data.corpora import generate_stories
from lmfs.show import source_of


def test_source_of_points_at_the_real_file():
    location, source = source_of(generate_stories)
    assert location.startswith("lmfs/data/corpora.py:")
    line = int(location.rsplit(":", 1)[1])
    file_lines = open(inspect.getsourcefile(generate_stories)).read().splitlines()
    assert file_lines[line - 1].startswith("def generate_stories")
    assert source.splitlines()[0] == file_lines[line - 1]


def test_show_prints_outside_jupyter(capsys):
    lmfs.show(generate_stories, lines=(1, 2))
    out = capsys.readouterr().out
    assert "generate_stories" in out and out.count("\n") == 3  # header + two lines


def test_show_rejects_objects_without_source():
    with pytest.raises(TypeError, match="cannot find the source"):
        lmfs.show(len)


def test_show_unwraps_triton_kernels():
    import lmfs.kernels  # noqa: F401  (sets up Triton: the interpreter without a GPU)
    from lmfs.kernels.gelu import gelu_fwd_kernel as kernel

    location, source = source_of(kernel)
    assert location.startswith("lmfs/kernels/gelu.py:") and "tl." in source
