"""Chat rendering against transformers' apply_chat_template with Gemma 3's published
template, on a tokenizer.json, a SentencePiece model and the byte tokenizer."""

import shutil

import jinja2
import numpy as np
import pytest
import transformers

from gemma_jax.text import chat
from gemma_jax.text import tokenizers
from test_tokenizers import train_bpe_json, train_sentencepiece

# The chat template of Gemma 3's tokenizer_config.json, as published (the reference).
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

U, A, M, S = "user", "assistant", "model", "system"
CONVERSATIONS = [
    [(U, "Hello!")],
    [(S, "You are terse."), (U, "What is 2 plus 2?"), (A, "2 plus 2 is 4.")],
    [(U, "  padded question \n\n"), (M, "\tan answer with spaces  "), (U, "again?"),
     (A, "yes\n")],
    [(S, "  System prompt kept as is  "), (U, "héllo wörld 👋🏽"), (M, "日本語 ✓")],
    [(U, "def f(x):\n    return x"), (A, "It returns x."), (U, ""), (M, "  ")],
]


def as_messages(conversation):
  return [{"role": role, "content": content} for role, content in conversation]


def assert_matches_transformers(ours, theirs):
  for conversation in CONVERSATIONS:
    messages = as_messages(conversation)
    for prompt in (False, True):
      expected = theirs.apply_chat_template(messages, tokenize=True,
                                            add_generation_prompt=prompt, return_dict=False)
      rendered = chat.render(messages, ours, add_generation_prompt=prompt)
      assert rendered.ids.dtype == np.int32 and rendered.weights.dtype == np.float32
      assert rendered.ids.tolist() == expected


def test_tokenizer_json_matches_apply_chat_template(tmp_path):
  path = train_bpe_json(tmp_path)
  theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=path, bos_token="<bos>",
                                                eos_token="<eos>", pad_token="<pad>")
  theirs.chat_template = GEMMA3_TEMPLATE
  assert_matches_transformers(tokenizers.get_tokenizer(path, 400), theirs)


def test_sentencepiece_model_matches_apply_chat_template(tmp_path):
  path = train_sentencepiece(tmp_path)
  (tmp_path / "gemma").mkdir()
  shutil.copyfile(path, tmp_path / "gemma" / "tokenizer.model")
  theirs = transformers.GemmaTokenizer.from_pretrained(str(tmp_path / "gemma"))
  theirs.chat_template = GEMMA3_TEMPLATE
  assert_matches_transformers(tokenizers.get_tokenizer(path, 512), theirs)


@pytest.mark.parametrize("name", ["byte", "json", "sentencepiece"])
def test_saved_template_renders_like_gemma3s(tmp_path, name):
  """save() writes our own jinja template; transformers renders it as the published one."""
  ours = {"byte": lambda: tokenizers.ByteTokenizer(),
          "json": lambda: tokenizers.get_tokenizer(train_bpe_json(tmp_path), 400),
          "sentencepiece": lambda: tokenizers.get_tokenizer(train_sentencepiece(tmp_path),
                                                            512)}[name]()
  ours.save(str(tmp_path / "saved"))
  theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "saved"))
  assert_matches_transformers(ours, theirs)
  theirs.chat_template = GEMMA3_TEMPLATE
  assert_matches_transformers(ours, theirs)


def test_byte_tokenizer_matches_the_template_text_byte_encoded():
  tok = tokenizers.ByteTokenizer()
  template = jinja2.Environment().from_string(GEMMA3_TEMPLATE)
  markers = {"<bos>": [1], "<start_of_turn>": [259], "<end_of_turn>": [260]}
  for conversation in CONVERSATIONS:
    for prompt in (False, True):
      text = template.render(messages=as_messages(conversation), bos_token="<bos>",
                             add_generation_prompt=prompt)
      expected = []
      while text:
        marker = next((m for m in markers if text.startswith(m)), None)
        expected += markers[marker] if marker else [3 + b for b in text[0].encode("utf-8")]
        text = text[len(marker) if marker else 1:]
      rendered = chat.render(as_messages(conversation), tok, add_generation_prompt=prompt)
      assert rendered.ids.tolist() == expected


def test_weights_mark_the_model_turns_content_and_end_of_turn():
  tok = tokenizers.ByteTokenizer()
  messages = as_messages(CONVERSATIONS[2])
  rendered = chat.render(messages, tok)
  # Reference: the learned bytes are each model turn's stripped content, then <eot>.
  learned = [b for m in messages if m["role"] != U
             for b in [*tok.encode([m["content"].strip()])[0].tolist(), 260]]
  assert rendered.ids[rendered.weights == 1].tolist() == learned
  assert set(rendered.weights.tolist()) == {0.0, 1.0}
  user_only = chat.render(as_messages(CONVERSATIONS[0]), tok, add_generation_prompt=True)
  assert not user_only.weights.any()


@pytest.mark.parametrize("kind", ["byte", "sentencepiece"])
def test_appending_turns_equals_rendering_the_whole_conversation(tmp_path, kind):
  tok = tokenizers.ByteTokenizer() if kind == "byte" else tokenizers.get_tokenizer(
      train_sentencepiece(tmp_path), 512)
  for conversation in CONVERSATIONS:
    messages = as_messages(conversation)
    first = 2 if messages[0]["role"] == S else 1
    for k in range(first, len(messages)):
      whole = chat.render(messages[:k + 1], tok).ids
      appended = np.concatenate([chat.render(messages[:k], tok).ids,
                                 chat.turn_ids(tok, messages[k]["role"],
                                               messages[k]["content"])])
      np.testing.assert_array_equal(appended, whole)
    prompt = chat.render(messages, tok, add_generation_prompt=True).ids
    np.testing.assert_array_equal(
        prompt, np.concatenate([chat.render(messages, tok).ids, chat.generation_prompt_ids(tok)]))


def test_gemma4_markers_give_the_system_prompt_its_own_turn():
  class Gemma4Bytes(tokenizers.ByteTokenizer):
    chat_style = "gemma4"
  tok = Gemma4Bytes()
  messages = as_messages(CONVERSATIONS[1])
  text = ("\x01<|turn>system\nYou are terse.<turn|>\n<|turn>user\nWhat is 2 plus 2?<turn|>\n"
          "<|turn>model\n2 plus 2 is 4.<turn|>\n<|turn>model\n")
  expected = [{"\x01": 1, "\x02": 259, "\x03": 260}.get(c) or 3 + ord(c) for c in
              text.replace("<|turn>", "\x02").replace("<turn|>", "\x03")]
  rendered = chat.render(messages, tok, add_generation_prompt=True)
  assert rendered.ids.tolist() == expected


@pytest.mark.parametrize("messages,message", [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    (["hello"], "message 0 is not an object"),
    ([{"content": "x"}], "message 0 has no 'role'"),
    ([{"role": "user"}], "message 0 has no 'content'"),
    ([{"role": "robot", "content": "x"}], "message 0 has unknown role 'robot'"),
    ([{"role": "user", "content": ["x"]}], "message 0 has list content, not a string"),
    ([{"role": "user", "content": None}], "message 0 has NoneType content"),
    ([{"role": "system", "content": "x"}], "system message but no user turn"),
    ([{"role": "model", "content": "x"}], "message 0 has role 'model' where 'user'"),
    ([{"role": "user", "content": "x"}, {"role": "user", "content": "y"}],
     "message 1 has role 'user' where 'model' belongs"),
    ([{"role": "user", "content": "x"}, {"role": "system", "content": "y"}],
     "message 1 has role 'system' where 'model'"),
])
def test_bad_conversations_name_what_is_wrong(messages, message):
  with pytest.raises(ValueError, match=message):
    chat.check_messages(messages)
  with pytest.raises(ValueError, match=message):
    chat.render(messages, tokenizers.ByteTokenizer())


def test_a_later_turn_cannot_be_a_system_turn():
  with pytest.raises(ValueError, match="not 'system'"):
    chat.turn_ids(tokenizers.ByteTokenizer(), "system", "x")
