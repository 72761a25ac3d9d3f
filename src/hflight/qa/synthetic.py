"""A deterministic synthetic extractive-QA data set in SQuAD JSON format.

Every paragraph is a short biography of a fictional person: 3 to 6 facts drawn from seven kinds
(birth city and year, occupation, employer and the year they joined, instrument, field and university
of study, pet and its name, number of siblings), each stated by one of a few sentence templates. The
person is introduced by full name; later sentences say "she", "he", the last name or the full name.
Most paragraphs also have *distractor* sentences: facts about another person (a friend, cousin,
colleague...) of kinds the paragraph does not state for the main person, which bring in other cities,
years and companies, and filler sentences that state no facts. Sentence order and the number of facts
and distractors vary, so answers sit at varied positions. Questions come from paraphrased templates
(several per slot); a paragraph has up to ``max_questions_per_paragraph`` questions about different
facts (sometimes both slots of one fact) and sometimes one about the distractor. Slots whose answer
type occurs more than once in a paragraph (cities, years, companies) are asked more often, since they
need actual reading rather than spotting the one instrument or animal of the paragraph.

The validation split uses people (first name + last name combinations) that never occur in the
training split, so its paragraphs and entity combinations are unseen. With
``version_2_with_negative=True`` about ``unanswerable_fraction`` of the questions are unanswerable
(``is_impossible: true``, no answers): half ask about a kind of fact the paragraph does not state for
the person (often one it states for the distractor), half about a person who is not in the paragraph.

The same arguments always give byte-identical files (see :func:`squad_to_json`). Learnability (CPU,
one thread): a BERT with hidden size 128, 2 layers, 2 heads and intermediate size 256 trained from
scratch on the default training split (12,482 questions, max_seq_length 128, batch 16, lr 1e-3,
2 epochs, about 1.5 minutes) reaches about 94 EM / 95 F1 on the validation split (850 questions).
"""

from __future__ import annotations

import json
import os
import random
import re
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hflight import durable
from hflight.qa import made

__all__ = ["generate_squad", "write_squad_files", "squad_to_json"]

# --------------------------------------------------------------------------------------------------
# Vocabulary of the generator. Changing any list changes the data set (and its determinism hash).
# fmt: off

_FEMALE = (
    "Anna Maria Sofia Elena Clara Nadia Priya Aiko Fatima Ingrid Lucia Mei Olga Rosa Tara Yara Zofia Leila "
    "Hannah Grace Amara Chiara Freya Irene Julia Kira Lena Mira Nora Paula Rina Selma Vera Wanda Alba Dalia"
).split()
_MALE = (
    "Adam Boris Carlos David Emil Felix Hugo Ivan Jonas Karim Liam Marco Nikolai Omar Pavel Rafael Samir "
    "Tomas Umar Viktor Yusuf Aaron Bruno Dmitri Elias Farid Gustav Hector Ilya Jakob Kenji Luca Matteo Otto "
    "Ravi Stefan"
).split()
_LAST = (
    "Novak Lindqvist Okafor Tanaka Moreau Petrov Haddad Kowalski Alvarez Brennan Castellano Dubois Eriksen "
    "Fontaine Gallagher Hoffmann Ishikawa Jansen Kaplan Larsen Mendoza Nakamura Oyelaran Pereira Quist "
    "Rahman Sandoval Takahashi Ulrich Varga Whitaker Yilmaz Zeller Abernathy Bianchi Costa Delgado Esposito "
    "Ferreira Grimaldi Horvath Ibarra Jovanovic Kristensen Lombardi Marchetti Nieminen Orlov Pacheco Romano "
    "Salvatore Toivonen Urquhart Valdez Wozniak Xavier Yamada Zamora Achterberg Bergstrom Caruso Drummond "
    "Everett Falkner Gutierrez Holloway Ivanova Jacobsen Kerensky Lachance Montague Nakashima Oberlin "
    "Prescott Quintero Rasmussen Sokolova Thorvald"
).split()
_CITIES = (
    "Lisbon", "Oslo", "Kraków", "Porto", "Lyon", "Graz", "Tampere", "Bergen", "Seville", "Utrecht",
    "Brno", "Ghent", "Turin", "Aarhus", "Malmö", "Bilbao", "Leipzig", "Dresden", "Split", "Cluj",
    "Riga", "Tartu", "Vilnius", "Kyoto", "Osaka", "Pune", "Mysore", "Izmir", "Tangier", "Accra",
    "Lagos", "Nairobi", "Quito", "Cusco", "Recife", "Rosario", "Halifax", "Winnipeg", "Tucson", "Boise",
    "New Haven", "San Mateo", "Port Elwin", "Marlow Bay", "East Calder", "Fort Sayer", "Kingsbridge",
    "Ashford", "Westmere", "Larkspur", "Old Harbor", "Stonebridge", "Millbrook", "Redwater", "Thornbury",
    "Clearwater Falls", "Saint Albans", "Bay Ridge", "North Lakes", "Glenrock",
)
_ORG_HEADS = (
    "Brightwater Kestrel Orion Meridian Northwind Bluefin Copperleaf Silverline Redstone Greenfield "
    "Harborview Ironbark Lumen Polaris Quarry Summit Tidewater Vantage Willow Zenith Aurora Cobalt Falcon "
    "Granite Juniper"
).split()
_ORG_TAILS = (
    "Labs", "Systems", "Textiles", "Analytics", "Foods", "Robotics", "Shipping", "Pharmaceuticals",
    "Press", "Energy", "Architects", "Bank", "Studios", "Motors", "Insurance",
)
_OCCUPATIONS = (
    "architect", "baker", "chemist", "carpenter", "dentist", "economist", "engineer", "florist",
    "geologist", "historian", "journalist", "librarian", "mechanic", "nurse", "pharmacist", "photographer",
    "pilot", "plumber", "software developer", "surgeon", "teacher", "translator", "veterinarian",
    "civil servant", "marine biologist", "police officer", "tax lawyer", "sound engineer", "chef",
    "tailor",
)
_INSTRUMENTS = (
    "violin", "cello", "piano", "trumpet", "flute", "clarinet", "harp", "accordion", "banjo", "saxophone",
    "drums", "oboe", "bass guitar", "ukulele", "trombone", "mandolin", "bagpipes", "harmonica",
)
_SUBJECTS = (
    "chemistry", "marine biology", "medieval history", "applied mathematics", "economics", "linguistics",
    "astronomy", "civil engineering", "philosophy", "music theory", "computer science", "geography",
    "political science", "art history", "mechanical engineering", "psychology", "statistics", "law",
    "architecture", "botany", "physics", "sociology", "classical literature", "nutrition science",
)
_ANIMALS = ("cat", "dog", "parrot", "rabbit", "tortoise", "horse", "hamster", "goat", "ferret", "donkey")
_PET_NAMES = (
    "Biscuit Pepper Luna Mango Shadow Pickle Ziggy Noodle Clover Maple Pumpkin Rocket Waffles Juniper "
    "Pebble Socks Tango Olive Bramble Comet Dusty Fudge Ginger Hazel Indigo Jasper Kiwi Lolly Mocha Nutmeg "
    "Oscar Paprika Quincy Rusty Sprout Toffee Velvet Whiskers"
).split()
_NUMBERS = ("one", "two", "three", "four", "five", "six", "seven")
_TOWN_FEATURES = (
    "old harbor", "covered market", "stone bridge", "botanical garden", "cathedral", "river festival",
    "jazz club", "central library", "railway museum", "lighthouse", "night market", "observatory",
    "town hall", "sculpture park", "fish market", "opera house",
)
_SEASONS = ("spring", "summer", "autumn", "winter")
_RELATIONS = ("friend", "cousin", "neighbor", "colleague", "former classmate", "business partner")
# fmt: on


# --------------------------------------------------------------------------------------------------
# A sentence is a template with ``{slot}`` fields; rendering records where each slot's value landed.

_DISTRACTOR_PROB = 0.6
_ASK_DISTRACTOR_PROB = 0.3
_FILLER_COUNTS = (0, 1, 1, 2)
# Filler sentences state no facts about anyone. They deliberately name no cities or years: with
# those, a 2-layer model needs several times the training budget to tell a birthplace from a filler
# city (cities and years still compete between facts, e.g. birth vs. university city, birth vs.
# joining year, and with the distractor person's facts).
_FILLERS = (
    "Every {season}, visitors crowd the {feature}.",
    "The {feature} is popular with tourists.",
    "Local papers often write about the {feature}.",
    "The {feature} closes early in {season}.",
    "Nobody remembers who built the {feature}.",
    "The {feature} was renovated last {season}.",
)
_READING_SLOTS = frozenset({"city", "year", "jyear", "university", "org"})
_READING_SLOT_WEIGHT = 2.0

_SLOT = re.compile(r"\{(\w+)\}")


def _render(template: str, values: dict[str, str]) -> tuple[str, dict[str, int]]:
    out: list[str] = []
    pos = 0
    length = 0
    where: dict[str, int] = {}
    for m in _SLOT.finditer(template):
        literal = template[pos : m.start()]
        out.append(literal)
        length += len(literal)
        value = values[m.group(1)]
        where.setdefault(m.group(1), length)
        out.append(value)
        length += len(value)
        pos = m.end()
    out.append(template[pos:])
    text = "".join(out)
    return text[0].upper() + text[1:], where


@dataclass
class _Person:
    first: str
    last: str
    female: bool
    birth_year: int
    city: str
    occupation: str
    org: str
    join_year: int
    instrument: str
    subject: str
    university_city: str
    animal: str
    pet: str
    siblings: int

    @property
    def name(self) -> str:
        return f"{self.first} {self.last}"

    @property
    def pron(self) -> str:
        return "she" if self.female else "he"

    @property
    def poss(self) -> str:
        return "her" if self.female else "his"


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


# Each fact: (attribute name, sentence templates, {answer slot: [question templates]}).
# Sentence templates use {S} for the subject (name, last name or pronoun) and {P} for the possessive.
# Question templates use {N} for the person's full name and the fact's own slots.
_FACTS: tuple[tuple[str, tuple[str, ...], dict[str, tuple[str, ...]]], ...] = (
    (
        "birth",
        (
            "{S} was born in {city} in {year}.",
            "{S} was born in {year} in {city}.",
        ),
        {
            "city": (
                "Where was {N} born?",
                "In which city was {N} born?",
                "What city is {N} a native of?",
                "What is the birthplace of {N}?",
                "{N} was born in which city?",
            ),
            "year": (
                "When was {N} born?",
                "In what year was {N} born?",
                "What year was {N} born in?",
                "What is the birth year of {N}?",
                "{N} was born in which year?",
            ),
        },
    ),
    (
        "occupation",
        (
            "{S} works as {a_occ} {occupation}.",
            "By profession, {S} is {a_occ} {occupation}.",
        ),
        {
            "occupation": (
                "What does {N} do for a living?",
                "What is the profession of {N}?",
                "What is {N}'s occupation?",
                "What job does {N} have?",
                "What does {N} work as?",
            ),
        },
    ),
    (
        "employer",
        (
            "{S} joined {org} in {jyear}.",
            "{S} has worked at {org} since {jyear}.",
        ),
        {
            "org": (
                "Which company did {N} join?",
                "Where does {N} work?",
                "What organization employs {N}?",
                "Which firm hired {N}?",
                "For which company does {N} work?",
            ),
            "jyear": (
                "When did {N} join {org}?",
                "In what year did {N} join {org}?",
                "Since when has {N} been with {org}?",
                "What year was {N} hired by {org}?",
            ),
        },
    ),
    (
        "instrument",
        (
            "{S} plays the {instrument}.",
            "In {P} free time, {S} plays the {instrument}.",
        ),
        {
            "instrument": (
                "What instrument does {N} play?",
                "Which instrument does {N} play?",
                "What musical instrument can {N} play?",
                "What does {N} play in {P} free time?",
            ),
        },
    ),
    (
        "study",
        (
            "{S} studied {subject} at the University of {ucity}.",
            "At the University of {ucity}, {S} studied {subject}.",
        ),
        {
            "subject": (
                "What did {N} study?",
                "Which subject did {N} study?",
                "What was the field of study of {N}?",
                "In what field did {N} earn a degree?",
            ),
            "university": (
                "Where did {N} study?",
                "Which university did {N} attend?",
                "At which university did {N} study {subject}?",
                "From which university did {N} graduate?",
            ),
        },
    ),
    (
        "pet",
        (
            "{S} has {a_animal} {animal} named {pet}.",
            "{S} owns {a_animal} {animal} called {pet}.",
        ),
        {
            "pet": (
                "What is the name of {N}'s {animal}?",
                "What is {N}'s {animal} called?",
                "What did {N} name {P} {animal}?",
            ),
            "animal": (
                "What kind of pet does {N} have?",
                "What animal does {N} own?",
                "What type of animal is {N}'s pet?",
            ),
        },
    ),
    (
        "siblings",
        (
            "{S} has {siblings} {sib_word}.",
            "{S} grew up with {siblings} {sib_word}.",
        ),
        {
            "siblings": (
                "How many siblings does {N} have?",
                "How many brothers and sisters does {N} have?",
                "With how many siblings did {N} grow up?",
            ),
        },
    ),
)

_FACT_BY_NAME = {f[0]: f for f in _FACTS}

# A sentence of a paragraph: (text, {slot: start within the text}, owner "main" / "other" / None for a filler,
# the fact it states or None).
_Sentence = tuple[str, dict[str, int], str | None, str | None]


def _slot_values(p: _Person) -> dict[str, str]:
    return {
        "city": p.city,
        "year": str(p.birth_year),
        "occupation": p.occupation,
        "a_occ": _article(p.occupation),
        "org": p.org,
        "jyear": str(p.join_year),
        "instrument": p.instrument,
        "subject": p.subject,
        "ucity": p.university_city,
        "university": f"University of {p.university_city}",
        "animal": p.animal,
        "a_animal": _article(p.animal),
        "pet": p.pet,
        "siblings": _NUMBERS[p.siblings - 1],
        "sib_word": "sibling" if p.siblings == 1 else "siblings",
        "pron": p.pron,
        "P": p.poss,
    }


# --------------------------------------------------------------------------------------------------


def _is_validation_name(first: str, last: str) -> bool:
    """A fixed split of all first/last name combinations: about one in five is held out for validation."""
    return zlib.crc32(f"{first} {last}".encode()) % 5 == 0


class _Generator:
    def __init__(self, rng: random.Random, validation: bool):
        self.rng = rng
        self.validation = validation

    def person(self, exclude: tuple[_Person, ...] = ()) -> _Person:
        """A new person whose first and last names both differ from those of ``exclude``."""
        rng = self.rng
        taken = {p.first for p in exclude} | {p.last for p in exclude}
        while True:
            female = rng.random() < 0.5
            first = rng.choice(_FEMALE if female else _MALE)
            last = rng.choice(_LAST)
            if _is_validation_name(first, last) == self.validation and first not in taken and last not in taken:
                break
        birth_year = rng.randint(1921, 2001)
        return _Person(
            first=first,
            last=last,
            female=female,
            birth_year=birth_year,
            city=rng.choice(_CITIES),
            occupation=rng.choice(_OCCUPATIONS),
            org=f"{rng.choice(_ORG_HEADS)} {rng.choice(_ORG_TAILS)}",
            join_year=min(birth_year + rng.randint(19, 40), 2024),
            instrument=rng.choice(_INSTRUMENTS),
            subject=rng.choice(_SUBJECTS),
            university_city=rng.choice(_CITIES),
            animal=rng.choice(_ANIMALS),
            pet=rng.choice(_PET_NAMES),
            siblings=rng.randint(1, len(_NUMBERS)),
        )

    def filler(self) -> str:
        rng = self.rng
        values = {"feature": rng.choice(_TOWN_FEATURES), "season": rng.choice(_SEASONS)}
        return _render(rng.choice(_FILLERS), values)[0]

    def paragraph(
        self, version_2: bool, unanswerable_fraction: float, max_questions: int, qid_prefix: str
    ) -> dict[str, Any]:
        """One biography paragraph with its questions, ids ``{qid_prefix}-q0``, ``-q1``, ..."""
        rng = self.rng
        main = self.person()
        n_facts = rng.randint(3, 6)
        facts = rng.sample([f[0] for f in _FACTS], n_facts)
        sentences = self._fact_sentences(main, facts)
        other, other_facts = self._add_distractor(sentences, main, facts)
        for _ in range(rng.choice(_FILLER_COUNTS)):
            sentences.insert(rng.randint(0, len(sentences)), (self.filler(), {}, None, None))
        context, offsets = _assemble(sentences)

        chosen = self._choose_questions(main, facts, other, other_facts, max_questions)
        qas = [
            self._answerable_qa(person, fact, slot, "main" if person is main else "other", context, offsets, version_2)
            for person, fact, slot in chosen
        ]
        if version_2 and unanswerable_fraction > 0:
            qas += self._unanswerable_qas(len(qas), unanswerable_fraction, main, other, facts)
            rng.shuffle(qas)

        for k, qa in enumerate(qas):
            qa["id"] = f"{qid_prefix}-q{k}"
        return {"context": context, "qas": qas}

    def _fact_sentences(self, main: _Person, facts: list[str]) -> list[_Sentence]:
        """One sentence per fact about ``main``: the first introduces the person by full name, the others
        (subject: pronoun, last name or full name) follow in random order."""
        rng = self.rng
        main_values = _slot_values(main)
        sentences: list[_Sentence] = []
        for k, fact in enumerate(facts):
            templates = _FACT_BY_NAME[fact][1]
            if k == 0:
                subject = main.name
            else:
                subject = rng.choice((main.pron, main.pron, main.last, main.name))
            text, where = _render(rng.choice(templates), {**main_values, "S": subject})
            sentences.append((text, where, "main", fact))
        tail = sentences[1:]
        rng.shuffle(tail)
        return sentences[:1] + tail

    def _add_distractor(
        self, sentences: list[_Sentence], main: _Person, facts: list[str]
    ) -> tuple[_Person | None, list[str]]:
        """Maybe insert (after the first sentence) one or two facts about a distractor person, of kinds the
        paragraph does not state for ``main``: they mention other cities, years, companies, ... and can be asked
        about too. Returns the distractor (``None`` if none) and its facts."""
        rng = self.rng
        other: _Person | None = None
        other_facts: list[str] = []
        absent = [f[0] for f in _FACTS if f[0] not in facts]
        if absent and rng.random() < _DISTRACTOR_PROB:
            other = self.person(exclude=(main,))
            other_values = _slot_values(other)
            other_facts = rng.sample(absent, min(len(absent), rng.randint(1, 2)))
            relation = rng.choice(_RELATIONS)
            lo = 1
            for j, fact in enumerate(other_facts):
                subject = f"{main.poss} {relation} {other.name}" if j == 0 else other.name
                text, where = _render(rng.choice(_FACT_BY_NAME[fact][1]), {**other_values, "S": subject})
                pos = rng.randint(lo, len(sentences))
                sentences.insert(pos, (text, where, "other", fact))
                lo = pos + 1
        return other, other_facts

    def _choose_questions(
        self, main: _Person, facts: list[str], other: _Person | None, other_facts: list[str], max_questions: int
    ) -> list[tuple[_Person, str, str]]:
        """``(person, fact, slot)`` to ask about: different facts of the main person (sometimes both slots of one
        fact), sometimes the distractor. Slots whose answer type also occurs elsewhere in the paragraph (cities,
        years, companies) need actual reading and are asked more often."""
        rng = self.rng
        candidates = [(fact, slot) for fact in facts for slot in _FACT_BY_NAME[fact][2]]
        chosen: list[tuple[_Person, str, str]] = []
        while candidates and len(chosen) < max_questions:
            weights = [_READING_SLOT_WEIGHT if slot in _READING_SLOTS else 1.0 for _, slot in candidates]
            fact, slot = candidates.pop(rng.choices(range(len(candidates)), weights=weights)[0])
            chosen.append((main, fact, slot))
        if other is not None and rng.random() < _ASK_DISTRACTOR_PROB:
            fact = rng.choice(other_facts)
            chosen.append((other, fact, rng.choice(list(_FACT_BY_NAME[fact][2]))))
        return chosen

    def _answerable_qa(
        self,
        person: _Person,
        fact: str,
        slot: str,
        owner: str,
        context: str,
        offsets: dict[tuple[str, str, str], int],
        version_2: bool,
    ) -> dict[str, Any]:
        """A question about ``slot`` of ``person``'s ``fact``, with its answer located in ``context`` (id unset)."""
        values = _slot_values(person)
        answer = values["university"] if slot == "university" else values[slot]
        slot_key = "ucity" if slot == "university" else slot
        start = offsets[(owner, fact, slot_key)]
        if slot == "university":
            start -= len("University of ")
        assert context[start : start + len(answer)] == answer, (context, answer, start)
        question = self.rng.choice(_FACT_BY_NAME[fact][2][slot]).format(N=person.name, **values)
        qa: dict[str, Any] = {"id": "", "question": question, "answers": [{"text": answer, "answer_start": start}]}
        if version_2:
            qa["is_impossible"] = False
        return qa

    def _unanswerable_qas(
        self, n_answerable: int, unanswerable_fraction: float, main: _Person, other: _Person | None, facts: list[str]
    ) -> list[dict[str, Any]]:
        """About ``unanswerable_fraction`` of all questions, unanswerable: half ask about a kind of fact the
        paragraph does not state for ``main``, half about a person who is not in the paragraph (ids unset)."""
        rng = self.rng
        expected = n_answerable * unanswerable_fraction / (1.0 - unanswerable_fraction)
        n_neg = int(expected) + (1 if rng.random() < expected - int(expected) else 0)
        absent = [f[0] for f in _FACTS if f[0] not in facts]
        qas: list[dict[str, Any]] = []
        for _ in range(n_neg):
            if absent and rng.random() < 0.5:
                # An attribute the paragraph does not state for the main person.
                fact = rng.choice(absent)
                person = main
            else:
                # A person who is not in the paragraph, asked about a fact kind that is present.
                fact = rng.choice(facts)
                person = self.person(exclude=(main, other) if other else (main,))
            slot = rng.choice(list(_FACT_BY_NAME[fact][2]))
            values = _slot_values(person)
            question = rng.choice(_FACT_BY_NAME[fact][2][slot]).format(N=person.name, **values)
            qas.append({"id": "", "question": question, "answers": [], "is_impossible": True})
        return qas


def _assemble(sentences: list[_Sentence]) -> tuple[str, dict[tuple[str, str, str], int]]:
    """The context (sentences joined by spaces) and where each ``(owner, fact, slot)`` value starts in it."""
    offsets: dict[tuple[str, str, str], int] = {}
    parts: list[str] = []
    pos = 0
    for text, where, owner, fact in sentences:
        if owner is not None:
            for slot, start in where.items():
                offsets.setdefault((owner, fact, slot), pos + start)
        parts.append(text)
        pos += len(text) + 1
    return " ".join(parts), offsets


def _split(
    split: str,
    num_articles: int,
    paragraphs_per_article: int,
    seed: int,
    version_2: bool,
    unanswerable_fraction: float,
    max_questions: int,
) -> dict[str, Any]:
    rng = random.Random(f"hflight-synthetic-squad/{seed}/{split}")
    gen = _Generator(rng, validation=(split == "validation"))
    data = []
    for a in range(num_articles):
        title = f"{rng.choice(_CITIES)} biographies {a + 1}"
        paragraphs = [
            gen.paragraph(version_2, unanswerable_fraction, max_questions, f"syn-{split}-{seed}-a{a}-p{p}")
            for p in range(paragraphs_per_article)
        ]
        data.append({"title": title, "paragraphs": paragraphs})
    return {"version": "v2.0" if version_2 else "1.1", "data": data}


def generate_squad(
    num_train_articles: int = 600,
    num_validation_articles: int = 40,
    paragraphs_per_article: int = 5,
    seed: int = 0,
    version_2_with_negative: bool = False,
    unanswerable_fraction: float = 1 / 3,
    max_questions_per_paragraph: int = 4,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Generate ``(train, validation)`` SQuAD dicts (``{"version": ..., "data": [...]}``).

    Args:
        num_train_articles / num_validation_articles: articles per split; each has
            ``paragraphs_per_article`` paragraphs (one biography each) with 3 to
            ``max_questions_per_paragraph`` answerable questions (+1 sometimes, about the distractor).
        seed: the same seed and arguments give identical data. Each split has its own random stream,
            so the validation split does not change when only ``num_train_articles`` changes.
        version_2_with_negative: SQuAD 2.0 layout with ``is_impossible`` and unanswerable questions.
        unanswerable_fraction: expected share of unanswerable questions (v2 only), in ``[0, 1)``.

    Sizes with the defaults: 12,482 training and 850 validation questions (v1.1); with
    ``version_2_with_negative`` 18,744 and 1,254, a third of them unanswerable. Generating takes
    well under a second per 10,000 questions.
    """
    if not 0.0 <= unanswerable_fraction < 1.0:
        raise ValueError(f"unanswerable_fraction must be in [0, 1), got {unanswerable_fraction}")
    for name, value in (
        ("num_train_articles", num_train_articles),
        ("num_validation_articles", num_validation_articles),
        ("paragraphs_per_article", paragraphs_per_article),
    ):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if max_questions_per_paragraph < 1:
        raise ValueError(f"max_questions_per_paragraph must be >= 1, got {max_questions_per_paragraph}")
    args = (paragraphs_per_article, seed, version_2_with_negative, unanswerable_fraction, max_questions_per_paragraph)
    train = _split("train", num_train_articles, *args)
    validation = _split("validation", num_validation_articles, *args)
    return train, validation


def squad_to_json(squad: dict[str, Any]) -> str:
    """The canonical serialization used by :func:`write_squad_files` (UTF-8 text, trailing newline)."""
    return json.dumps(squad, ensure_ascii=False, indent=1) + "\n"


def write_squad_files(
    out_dir: str | os.PathLike,
    num_train_articles: int = 600,
    num_validation_articles: int = 40,
    paragraphs_per_article: int = 5,
    seed: int = 0,
    version_2_with_negative: bool = False,
    unanswerable_fraction: float = 1 / 3,
    max_questions_per_paragraph: int = 4,
    train_name: str = "train.json",
    validation_name: str = "validation.json",
    resuming: bool = False,
) -> tuple[Path, Path]:
    """Generate with :func:`generate_squad` and write ``(train_path, validation_path)`` under ``out_dir``.

    The files are byte-identical for the same arguments. Files this function wrote before with the same arguments
    are reused as they are (``hflight.qa.made``: a restarted run trains on exactly what its checkpoints were trained
    on); ``resuming``: the run continues from a checkpoint, so files written with other arguments are an error
    naming the difference (otherwise they are replaced).
    """
    out = Path(out_dir)
    paths = (out / train_name, out / validation_name)
    settings = dict(
        num_train_articles=num_train_articles,
        num_validation_articles=num_validation_articles,
        paragraphs_per_article=paragraphs_per_article,
        seed=seed,
        version_2_with_negative=version_2_with_negative,
        unanswerable_fraction=unanswerable_fraction,
        max_questions_per_paragraph=max_questions_per_paragraph,
    )
    recipe = dict(generator="hflight.qa.synthetic.write_squad_files", **settings, files=[train_name, validation_name])
    if made.reusable(out, recipe, [train_name, validation_name], "synthetic SQuAD data", resuming):
        return paths
    train, validation = generate_squad(**settings)
    out.mkdir(parents=True, exist_ok=True)
    for path, squad in zip(paths, (train, validation)):
        replace_file(path, squad_to_json(squad).encode("utf-8"))
    made.write_record(out, recipe)
    return paths


def replace_file(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all (a temporary file renamed over it): processes launched together (torchrun)
    write the same files, and none of them may read another's half-written one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        durable.replace_file(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
