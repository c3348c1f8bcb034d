"""The configuration documents itself: every key carries its help as field metadata,
`replayrl config explain` prints it, and docs/configuration.md is generated from it."""

import dataclasses
from pathlib import Path

import pytest

from replayrl.cli.main import main
from replayrl.config import SECTIONS, BufferConfig, RunConfig, TrainConfig
from replayrl.config.explain import DOCS_COMMAND, DOCS_PATH, render_markdown, sections, select
from replayrl.config.run import CHECK_ORDER
from replayrl.errors import ReplayRLError

pytestmark = pytest.mark.unit
ROOT = Path(__file__).parents[2]


def test_docs_configuration_md_is_generated_from_the_code():
    committed = (ROOT / DOCS_PATH).read_text(encoding="utf-8")
    assert committed == render_markdown(), (
        f"{DOCS_PATH} is stale: regenerate it with `{DOCS_COMMAND}` and commit it."
    )


def test_every_key_has_help():
    undocumented = [k.key for s in sections() for k in s.knobs if len(k.help) < 10]
    assert not undocumented, f"add metadata={{'help': ...}} to: {undocumented}"
    assert all(s.doc for s in sections()), "every section dataclass needs a docstring"


def test_explain_covers_every_key_of_the_config():
    keys = [k.key for s in sections() for k in s.knobs]
    expected = [f.name for f in dataclasses.fields(RunConfig) if f.name not in SECTIONS]
    for name, cls in SECTIONS.items():
        expected += [f"{name}.{f.name}" for f in dataclasses.fields(cls)]
    assert keys == expected
    assert set(RunConfig().flat()) <= set(keys)


def test_every_section_is_checked():
    assert sorted(CHECK_ORDER) == sorted(SECTIONS)
    assert all(callable(getattr(cls, "check", None)) for cls in SECTIONS.values())


def test_sections_check_their_own_fields():
    with pytest.raises(ReplayRLError, match="buffer.positive_bias must be in"):
        BufferConfig(positive_bias=1.5).check()
    with pytest.raises(ReplayRLError, match="train.is_cap only applies to train.loss=asymre"):
        TrainConfig(is_cap=2.0).check()
    for cls in SECTIONS.values():
        cls().check()  # the defaults pass


def test_select_a_section_a_key_or_all():
    assert [s.name for s in select("buffer")] == ["buffer"]
    (only,) = select("buffer.capacity")
    assert [k.key for k in only.knobs] == ["buffer.capacity"]
    assert only.knobs[0].default == 512 and "capacity in rollouts" in only.knobs[0].help
    assert [k.key for k in select("iterations")[0].knobs] == ["iterations"]
    assert len(select()) == len(SECTIONS) + 1


def test_unknown_names_suggest_the_nearest():
    with pytest.raises(
        ReplayRLError, match="Unknown config section 'bufer'. Did you mean 'buffer'"
    ):
        select("bufer")
    with pytest.raises(ReplayRLError, match="Did you mean 'buffer.capacity'"):
        select("buffer.capacty")


def test_cli_explain_prints_keys_types_defaults_and_help(capsys):
    assert main(["config", "explain", "buffer"]) == 0
    out = capsys.readouterr().out
    assert "buffer.capacity (int, default 512)" in out
    assert "buffer.max_staleness (int | None, default null)" in out
    assert "train." not in out
    assert main(["config", "explain"]) == 0
    out = capsys.readouterr().out
    for f in dataclasses.fields(RunConfig):
        assert f.name in out


def test_cli_explain_unknown_section_is_a_one_line_error(capsys):
    assert main(["config", "explain", "bufer"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("replayrl: error: Unknown config section 'bufer'")
    assert "Did you mean 'buffer'?" in err and "Traceback" not in err


def test_cli_docs_writes_the_markdown(tmp_path, capsys):
    out = tmp_path / "configuration.md"
    assert main(["config", "docs", "--out", str(out)]) == 0
    assert out.read_text(encoding="utf-8") == render_markdown()
    assert main(["config", "docs"]) == 0
    assert capsys.readouterr().out == render_markdown()
