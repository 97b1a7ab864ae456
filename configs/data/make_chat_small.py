"""Writes chat_small.jsonl: short, regular conversations a tiny model learns quickly.

Arithmetic, spelling and reversing words, unit conversions and a small table of facts,
each answered in one fixed sentence form; some with a system prompt, some multi-turn.
Deterministic (seeded, standard library only): `python configs/data/make_chat_small.py`.
"""

import json
import os
import random

WORDS = ("cat dog sun tree book fish bird lamp door milk rain star moon ship cake frog "
         "king leaf road sand wind snow blue gold rock hill bell coin drum nest").split()
CAPITALS = {"France": "Paris", "Japan": "Tokyo", "Italy": "Rome", "Spain": "Madrid",
            "Egypt": "Cairo", "Peru": "Lima", "Kenya": "Nairobi", "Chile": "Santiago",
            "Norway": "Oslo", "Cuba": "Havana", "Greece": "Athens", "Canada": "Ottawa"}
COLORS = {"grass": "green", "the sky": "blue", "snow": "white", "coal": "black",
          "a banana": "yellow", "blood": "red", "an orange": "orange", "a plum": "purple"}
LEGS = {"a spider": 8, "a dog": 4, "a bird": 2, "an ant": 6, "a fish": 0, "a cat": 4,
        "a crab": 10, "a snake": 0}
UNITS = [("meters", "centimeters", 100), ("kilograms", "grams", 1000),
         ("hours", "minutes", 60), ("minutes", "seconds", 60), ("days", "hours", 24),
         ("feet", "inches", 12), ("weeks", "days", 7)]
SYSTEMS = ["Answer in one sentence.", "You are a helpful assistant.", "Be brief."]


def arithmetic(rng):
  op = rng.choice(["plus", "minus", "times"])
  a, b = (rng.randint(0, 12), rng.randint(0, 12)) if op == "times" else \
      (rng.randint(0, 50), rng.randint(0, 50))
  value = {"plus": a + b, "minus": a - b, "times": a * b}[op]
  return f"What is {a} {op} {b}?", f"{a} {op} {b} is {value}."


def spelling(rng):
  word = rng.choice(WORDS)
  return f"Spell {word}.", f"{word} is spelled {'-'.join(word)}."


def reversing(rng):
  word = rng.choice(WORDS)
  return f"Reverse {word}.", f"{word} reversed is {word[::-1]}."


def conversion(rng):
  big, small, factor = rng.choice(UNITS)
  n = rng.randint(1, 9)
  return (f"How many {small} are in {n} {big}?",
          f"There are {n * factor} {small} in {n} {big}.")


def fact(rng):
  kind = rng.randrange(3)
  if kind == 0:
    country = rng.choice(sorted(CAPITALS))
    return f"What is the capital of {country}?", \
        f"The capital of {country} is {CAPITALS[country]}."
  if kind == 1:
    thing = rng.choice(sorted(COLORS))
    return f"What color is {thing}?", f"The color of {thing} is {COLORS[thing]}."
  animal = rng.choice(sorted(LEGS))
  return f"How many legs does {animal} have?", f"{animal.capitalize()} has {LEGS[animal]} legs."


TASKS = (arithmetic, spelling, reversing, conversion, fact)


def conversation(rng):
  """A list of messages: 1-3 exchanges, a system prompt one time in four."""
  messages = []
  if rng.random() < 0.25:
    messages.append({"role": "system", "content": rng.choice(SYSTEMS)})
  turns = rng.choices([1, 2, 3], weights=[6, 3, 1])[0]
  for _ in range(turns):
    question, answer = rng.choice(TASKS)(rng)
    messages.append({"role": "user", "content": question})
    messages.append({"role": rng.choice(["assistant", "model"]), "content": answer})
  return messages


def main(path=os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat_small.jsonl"),
         count=700, seed=0):
  rng = random.Random(seed)
  with open(path, "w", encoding="utf-8") as f:
    for _ in range(count):
      f.write(json.dumps({"messages": conversation(rng)}) + "\n")


if __name__ == "__main__":
  main()
