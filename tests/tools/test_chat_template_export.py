"""The chat template of an exported SFT job (`maester convert to-hf`): for every built-in template and for the marker
format, `transformers`' `apply_chat_template` on the exported tokenizer files, maester reading the export back (what
`maester chat` and `generate --chat` on the HF directory use) and the job's own encoding give the same ids; the
template's `{% generation %}` marks the tokens the job trains."""

from __future__ import annotations

import io

import pytest

from maester.config import Config
from maester.data.chat import ChatEncoder
from maester.data.chat.builtin import LAYOUTS
from maester.data.tokenizers import build_tokenizer
from maester.tools.convert import to_hf, write_tokenizer_files
from maester.tools.hf_dir import hf_tokenizer_settings
from tests.data.test_chat import CONVERSATION, MARKERS, SYSTEM, write_hf
from tests.helpers import seed_job, write_corpus

CONVERSATIONS = [
    CONVERSATION,
    [SYSTEM, *CONVERSATION],
    [{"role": "user", "content": "Kā iet?\n"}, {"role": "assistant", "content": "Labi 😀\n\n"},
     {"role": "user", "content": "Un tev? {{ '%}' }} \"x\""}],  # ends with a question; Jinja syntax in the content
]
TEMPLATES = [*LAYOUTS, "markers"]  # every built-in layout, and the marker format


def job_config(template: str, tokenizer: dict, system_prompt: str | None = None) -> Config:
    sft = {"template": template, **({"system_prompt": system_prompt} if system_prompt else {})}
    tree = {"model": {"flavor": "tiny"}, "tokenizer": tokenizer, "data": {"mode": "sft", "sft": sft}}
    if template == "markers":
        tree["tokenizer"] = {**tokenizer, "control_tokens": MARKERS}
    return Config.model_validate(tree)


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    return str(write_hf(tmp_path_factory.mktemp("hf")).parent)


def export(cfg: Config, directory):
    """The tokenizer files `to_hf` writes for the job, without a model."""
    directory.mkdir()
    write_tokenizer_files(cfg, build_tokenizer(cfg.tokenizer), directory, 512, {})
    return directory


@pytest.mark.parametrize("kind", ["byte", "hf"])
@pytest.mark.parametrize("template", TEMPLATES)
def test_apply_chat_template_and_maester_on_the_export_give_the_jobs_ids(template, kind, hf_tokenizer, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = {"kind": "byte"} if kind == "byte" else {"kind": "hf", "path": hf_tokenizer}
    for system_prompt in (None, "Answer briefly."):
        cfg = job_config(template, tokenizer, system_prompt)
        ours = ChatEncoder(build_tokenizer(cfg.tokenizer), cfg.data.sft, cfg.tokenizer.path)
        directory = export(cfg, tmp_path / f"export-{system_prompt is not None}")
        theirs = AutoTokenizer.from_pretrained(directory)
        settings = Config.model_validate(hf_tokenizer_settings(directory, {}))
        assert settings.data.sft.template == "jinja"  # maester reads the export's own template
        back = ChatEncoder(build_tokenizer(settings.tokenizer), settings.data.sft, settings.tokenizer.path)
        assert back.stop_ids() == ours.stop_ids()
        for conversation in CONVERSATIONS:
            encoded = ours.encode(conversation)
            hf = theirs.apply_chat_template(conversation, return_dict=True, return_assistant_tokens_mask=True)
            assert hf["input_ids"] == encoded.tokens.tolist(), (template, conversation)
            # {% generation %} marks what assistant_only trains (nothing precedes the first token)
            assert [bool(m) for m in hf["assistant_masks"][1:]] == encoded.trained[1:].tolist()
            read_back = back.encode(conversation)
            assert read_back.tokens.tolist() == encoded.tokens.tolist()
            assert read_back.trained.tolist() == encoded.trained.tolist()  # fine-tuning the export trains the same
            for k, message in enumerate(conversation):
                if message["role"] == "assistant":
                    prompt = ours.prompt(conversation[:k])[0]
                    assert theirs.apply_chat_template(conversation[:k], add_generation_prompt=True,
                                                      return_dict=False) == prompt
                    assert back.prompt(conversation[:k])[0] == prompt


def test_a_role_the_template_refuses_is_refused_by_the_export(tmp_path):
    from jinja2.exceptions import TemplateError
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(export(job_config("gemma", {"kind": "byte"}), tmp_path / "gemma"))
    with pytest.raises(TemplateError, match="role tool is not one of assistant, system, user"):
        theirs.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(TemplateError, match="a system message may only come first"):
        theirs.apply_chat_template([*CONVERSATION[:1], SYSTEM])


def test_maester_chat_on_the_export_answers_as_on_the_job(tmp_path, monkeypatch, capsys):
    """The walkthrough's case: a markers SFT job, converted, then chatted with through both directories."""
    from maester.cli import main

    corpus = write_corpus(tmp_path / "corpus.parquet", n_docs=20)
    # the byte tokenizer's own vocabulary, not rounded up: a random model samples none of the padding ids
    job = seed_job(corpus, tmp_path / "jobs", "markers", data__mode="sft", data__sft__template="markers",
                   tokenizer__control_tokens='{"<<<|user|>>>": "<|user|>", "<<<|assistant|>>>": "<|assistant|>"}',
                   model__overrides='{"vocab_size": 269}')
    out = to_hf(job, tmp_path / "hf")
    answers = []
    for target in (job, out):
        monkeypatch.setattr("sys.stdin", io.StringIO("What is 3 plus 4?\nAnd 5?\n/quit\n"))
        main(["chat", str(target), "--max-new-tokens", "12", "--device", "cpu"])
        answers.append(capsys.readouterr().out)
    assert answers[0].count("assistant> ") == 2 and answers[0] == answers[1]
