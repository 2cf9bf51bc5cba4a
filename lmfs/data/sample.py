"""A generated web site: the crawl sample the data lectures run on without a network.

:func:`generate_site` writes, deterministically for a seed, the kinds of pages a crawl is full of,
each labelled with its ``kind`` and (for extraction scoring) its true main text:

* ``article``: English prose wrapped in a site's boilerplate (menu, cookie notice, "enable
  JavaScript" line, footer with policy links); the prose is real: paragraphs of CPython's bundled
  documentation (``pydoc_data``), drawn at random;
* ``foreign``: the same kind of page in German, French, Spanish, Italian, Dutch or Russian;
* ``duplicate`` / ``near-duplicate``: an article served again under another URL, verbatim or with
  a few words changed;
* ``pii``: an article that names e-mail addresses, phone numbers and IPv4/IPv6 addresses (all from
  the ranges reserved for documentation: example.org, 555 numbers, 192.0.2.0/24, 2001:db8::/32);
* low-quality pages: ``spam`` (repeated keywords), ``short``, ``symbols`` (hashtags and ellipses),
  ``bullets`` (only list items), ``code`` (curly brackets), ``lorem`` (placeholder text);
* broken input: ``non-html`` (an image), ``empty`` (a page with no text), ``latin-1`` (a page
  declaring its legacy encoding), ``undecodable`` (bytes that are no valid text in the declared one).

Other text is built here from small hand-written phrase lists (no third-party text); being
made of few phrases, it repeats itself more than prose does.
:func:`sample_texts` gives clean paragraphs per language for training a language identifier.
"""

from __future__ import annotations

import html
import random
import re
from dataclasses import dataclass

# Phrase lists per language: subject, verb (third person singular), object, adverbial, opener.
# Sentences are built as [opener] subject verb object adverbial. Every entry is an own phrase.
PHRASES = {
    "en": dict(
        subj=["The city council", "Our small team", "The new library", "A local farmer", "The old bridge",
              "This short guide", "The weather service", "The museum", "My neighbour", "The school",
              "The bakery on the corner", "A young engineer", "The village choir", "The harbour office"],
        verb=["builds", "describes", "needs", "opens", "changes", "protects", "explains", "improves",
              "visits", "repairs", "plans", "shows", "collects", "supports"],
        obj=["a new park", "the main road", "the evening market", "a simple method", "the water supply",
             "the school garden", "an old map", "the train schedule", "a quiet reading room",
             "the bicycle paths", "the annual report", "a small exhibition", "the public kitchen"],
        adv=["every spring", "after the long winter", "with great care", "near the harbour",
             "for the first time", "without any help", "in the early morning", "because of the rain",
             "before the holidays", "at the end of the month", "with the help of volunteers"],
        open=["However,", "In addition,", "For this reason,", "Last year,", "As expected,", "Of course,"]),
    "de": dict(
        subj=["Der Stadtrat", "Unser kleines Team", "Die neue Bibliothek", "Ein junger Bauer", "Die alte Brücke",
              "Dieser kurze Leitfaden", "Der Wetterdienst", "Das Museum", "Meine Nachbarin", "Die Schule",
              "Die Bäckerei an der Ecke", "Eine junge Ingenieurin", "Der Dorfchor"],
        verb=["baut", "beschreibt", "braucht", "öffnet", "verändert", "schützt", "erklärt", "verbessert",
              "besucht", "repariert", "plant", "zeigt", "sammelt"],
        obj=["einen neuen Park", "die Hauptstraße", "den Abendmarkt", "eine einfache Methode",
             "die Wasserversorgung", "den Schulgarten", "eine alte Karte", "den Fahrplan",
             "einen ruhigen Lesesaal", "die Radwege", "den Jahresbericht", "eine kleine Ausstellung"],
        adv=["jeden Frühling", "nach dem langen Winter", "mit großer Sorgfalt", "in der Nähe des Hafens",
             "zum ersten Mal", "ohne fremde Hilfe", "am frühen Morgen", "wegen des Regens",
             "vor den Ferien", "am Ende des Monats", "mit Hilfe von Freiwilligen"],
        open=["Außerdem", "Deshalb", "Letztes Jahr", "Wie erwartet", "Natürlich", "Trotzdem"]),
    "fr": dict(
        subj=["Le conseil municipal", "Notre petite équipe", "La nouvelle bibliothèque", "Un jeune agriculteur",
              "Le vieux pont", "Ce petit guide", "Le service météo", "Le musée", "Ma voisine", "L'école",
              "La boulangerie du coin", "Une jeune ingénieure", "La chorale du village"],
        verb=["construit", "décrit", "demande", "ouvre", "change", "protège", "explique", "améliore",
              "visite", "répare", "prépare", "montre", "rassemble"],
        obj=["un nouveau parc", "la route principale", "le marché du soir", "une méthode simple",
             "l'alimentation en eau", "le jardin de l'école", "une vieille carte", "les horaires des trains",
             "une salle de lecture calme", "les pistes cyclables", "le rapport annuel", "une petite exposition"],
        adv=["chaque printemps", "après le long hiver", "avec beaucoup de soin", "près du port",
             "pour la première fois", "sans aucune aide", "tôt le matin", "à cause de la pluie",
             "avant les vacances", "à la fin du mois", "avec l'aide des bénévoles"],
        open=["Cependant,", "De plus,", "Pour cette raison,", "L'année dernière,", "Comme prévu,", "Bien sûr,"]),
    "es": dict(
        subj=["El ayuntamiento", "Nuestro pequeño equipo", "La nueva biblioteca", "Un joven agricultor",
              "El puente viejo", "Esta breve guía", "El servicio meteorológico", "El museo", "Mi vecina",
              "La escuela", "La panadería de la esquina", "Una joven ingeniera", "El coro del pueblo"],
        verb=["construye", "describe", "necesita", "abre", "cambia", "protege", "explica", "mejora",
              "visita", "repara", "planea", "muestra", "reúne"],
        obj=["un parque nuevo", "la calle principal", "el mercado de la tarde", "un método sencillo",
             "el suministro de agua", "el huerto escolar", "un mapa antiguo", "el horario de los trenes",
             "una sala de lectura tranquila", "los carriles para bicicletas", "el informe anual",
             "una pequeña exposición"],
        adv=["cada primavera", "después del largo invierno", "con mucho cuidado", "cerca del puerto",
             "por primera vez", "sin ninguna ayuda", "temprano por la mañana", "a causa de la lluvia",
             "antes de las vacaciones", "a final de mes", "con la ayuda de voluntarios"],
        open=["Sin embargo,", "Además,", "Por esta razón,", "El año pasado,", "Como se esperaba,", "Por supuesto,"]),
    "it": dict(
        subj=["Il consiglio comunale", "La nostra piccola squadra", "La nuova biblioteca", "Un giovane contadino",
              "Il vecchio ponte", "Questa breve guida", "Il servizio meteo", "Il museo", "La mia vicina",
              "La scuola", "Il forno all'angolo", "Una giovane ingegnera", "Il coro del paese"],
        verb=["costruisce", "descrive", "chiede", "apre", "cambia", "protegge", "spiega", "migliora",
              "visita", "ripara", "prepara", "mostra", "raccoglie"],
        obj=["un nuovo parco", "la strada principale", "il mercato serale", "un metodo semplice",
             "la rete idrica", "l'orto della scuola", "una vecchia mappa", "l'orario dei treni",
             "una sala di lettura tranquilla", "le piste ciclabili", "la relazione annuale",
             "una piccola mostra"],
        adv=["ogni primavera", "dopo il lungo inverno", "con grande cura", "vicino al porto",
             "per la prima volta", "senza alcun aiuto", "la mattina presto", "a causa della pioggia",
             "prima delle vacanze", "alla fine del mese", "con l'aiuto dei volontari"],
        open=["Tuttavia,", "Inoltre,", "Per questo motivo,", "L'anno scorso,", "Come previsto,", "Certo,"]),
    "nl": dict(
        subj=["De gemeenteraad", "Ons kleine team", "De nieuwe bibliotheek", "Een jonge boer", "De oude brug",
              "Deze korte gids", "De weerdienst", "Het museum", "Mijn buurvrouw", "De school",
              "De bakkerij op de hoek", "Een jonge ingenieur", "Het dorpskoor"],
        verb=["bouwt", "beschrijft", "zoekt", "opent", "verandert", "beschermt", "bespreekt",
              "verbetert", "bezoekt", "repareert", "plant", "toont", "verzamelt"],
        obj=["een nieuw park", "de hoofdweg", "de avondmarkt", "een eenvoudige methode",
             "de watervoorziening", "de schooltuin", "een oude kaart", "de dienstregeling",
             "een rustige leeszaal", "de fietspaden", "het jaarverslag", "een kleine tentoonstelling"],
        adv=["elk voorjaar", "na de lange winter", "met grote zorg", "vlak bij de haven",
             "voor het eerst", "zonder enige hulp", "vroeg in de ochtend", "vanwege de regen",
             "voor de vakantie", "aan het einde van de maand", "met hulp van vrijwilligers"],
        open=["Bovendien", "Daarom", "Vorig jaar", "Zoals verwacht", "Natuurlijk", "Toch"]),
    "ru": dict(
        subj=["Городской совет", "Наша небольшая команда", "Новая библиотека", "Молодой фермер",
              "Старый мост", "Это краткое руководство", "Метеослужба", "Музей", "Моя соседка", "Школа",
              "Пекарня на углу", "Молодая инженер", "Деревенский хор"],
        verb=["строит", "описывает", "ищет", "открывает", "меняет", "защищает", "объясняет", "улучшает",
              "посещает", "ремонтирует", "планирует", "показывает", "собирает"],
        obj=["новый парк", "главную дорогу", "вечерний рынок", "простой метод", "водопровод",
             "школьный сад", "старую карту", "расписание поездов", "тихий читальный зал",
             "велосипедные дорожки", "годовой отчёт", "небольшую выставку"],
        adv=["каждую весну", "после долгой зимы", "с большой заботой", "рядом с гаванью", "впервые",
             "без чужой помощи", "рано утром", "из-за дождя", "перед праздниками", "в конце месяца",
             "с помощью волонтёров"],
        open=["Однако,", "Кроме того,", "Поэтому", "В прошлом году", "Как и ожидалось,", "Конечно,"]),
    # Chinese: no spaces between words, the adverbial before the verb, a full-width full stop.
    "zh": dict(
        subj=["市议会", "我们的小团队", "新图书馆", "一位年轻的农民", "那座老桥", "这本简短的指南", "气象局",
              "博物馆", "我的邻居", "这所学校", "街角的面包店", "一位年轻的工程师", "村里的合唱团"],
        verb=["建造", "描述", "需要", "打开", "改变", "保护", "解释", "改进", "参观", "修理", "计划", "展示",
              "收集"],
        obj=["一个新公园", "主要道路", "晚上的集市", "一种简单的方法", "供水系统", "学校的菜园", "一张旧地图",
             "火车时刻表", "一间安静的阅览室", "自行车道", "年度报告", "一个小型展览"],
        adv=["每年春天", "在漫长的冬天之后", "非常仔细地", "在港口附近", "第一次", "在没有任何帮助的情况下",
             "在清晨", "因为下雨", "在假期之前", "在月底", "在志愿者的帮助下"],
        open=["但是，", "此外，", "因此，", "去年，", "正如预期，", "当然，"]),
}
LANGUAGES = tuple(PHRASES)
# The generated site's foreign pages (Chinese is used for language identification only).
SITE_FOREIGN = ("de", "fr", "es", "it", "nl", "ru")
# German and Dutch put the verb second: after an opener, the subject follows the verb.
_V2 = {"de", "nl"}
_NO_SPACES = {"zh"}


def sentence(rng: random.Random, lang: str, half: int | None = None) -> str:
    """One sentence in ``lang`` from :data:`PHRASES`. ``half`` 0 or 1 draws only the phrases at even or
    odd positions of each list, so that texts of one half share no phrase with texts of the other (a
    classifier trained on one half is tested on words it never saw)."""
    p = PHRASES[lang] if half is None else {k: v[half::2] for k, v in PHRASES[lang].items()}
    subj, verb, obj, adv = (rng.choice(p[k]) for k in ("subj", "verb", "obj", "adv"))
    if lang in _NO_SPACES:
        opener = rng.choice(p["open"]) if rng.random() < 0.3 else ""
        return f"{opener}{subj}{adv}{verb}{obj}。"
    if rng.random() < 0.3:
        opener = rng.choice(p["open"])
        if lang in _V2:  # "Deshalb baut der Stadtrat ...": verb second, subject after it
            return f"{opener} {verb} {subj[0].lower() + subj[1:]} {obj} {adv}."
        return f"{opener} {subj[0].lower() + subj[1:]} {verb} {obj} {adv}."
    return f"{subj} {verb} {obj} {adv}."


def paragraph(rng: random.Random, lang: str, n_sentences: int | None = None, half: int | None = None) -> str:
    sep = "" if lang in _NO_SPACES else " "
    return sep.join(sentence(rng, lang, half) for _ in range(n_sentences or rng.randint(3, 6)))


_PROSE: list[str] = []


def english_paragraphs(rng: random.Random, k: int) -> list[str]:
    """``k`` paragraphs of real English prose: CPython's bundled documentation (``pydoc_data``), the
    paragraphs that read as text (25+ words, ending in a full stop, no code)."""
    if not _PROSE:
        from lmfs.data.corpora import pydoc_text
        for block in re.split(r"\n\s*\n", pydoc_text()):
            p = " ".join(block.split())
            if (len(p.split()) >= 25 and p.endswith(".") and "{" not in p and not p.startswith((">>>", "*"))
                    and sum(c.isalpha() for c in p) > 0.75 * len(p)):
                _PROSE.append(p)
    return rng.sample(_PROSE, k)


def sample_texts(n_per_lang: int, seed: int = 0, half: int | None = None) -> tuple[list[str], list[str]]:
    """``n_per_lang`` paragraphs in each of :data:`LANGUAGES`, shuffled: ``(texts, labels)``.

    ``half``: as in :func:`sentence`; None draws from every phrase."""
    rng = random.Random(seed)
    pairs = [(paragraph(rng, lang, rng.randint(1, 4), half), lang) for lang in LANGUAGES for _ in range(n_per_lang)]
    rng.shuffle(pairs)
    return [t for t, _ in pairs], [lang for _, lang in pairs]


# Hard cases for language identification (lecture 13): how a paragraph introduces a code example in
# each language, and short code snippets of several kinds. Every entry is written for this module.
_CODE_INTRO = {"en": "For example:", "de": "Zum Beispiel:", "fr": "Par exemple :", "es": "Por ejemplo:",
               "it": "Per esempio:", "nl": "Bijvoorbeeld:", "ru": "Например:", "zh": "例如："}
CODE_SNIPPETS = [
    "for i in range(10):\n    total += prices[i]",
    "$ sudo apt-get install python3-doc",
    "if (x > 0) { return x * 2; }",
    'config = {"timeout": 30, "retries": 3}',
    'git commit -m "fix the parser"',
    "SELECT name, email FROM users WHERE id = 42;",
    "def area(r):\n    return 3.14159 * r ** 2",
    "export PATH=$HOME/bin:$PATH",
    "print(len(words), sorted(counts.items()))",
    '<a class="button" href="/download">Download</a>',
]
LANGID_CATEGORIES = ("paragraph", "short", "mixed", "code")


def _snippet(rng: random.Random, lang: str, half: int | None) -> str:
    """Two to four consecutive words of a sentence (three to six characters for Chinese)."""
    text = sentence(rng, lang, half).rstrip("。.")
    if lang in _NO_SPACES:
        k = rng.randint(3, 6)
        start = rng.randint(0, max(len(text) - k, 0))
        return text[start:start + k]
    words = text.split()
    k = min(rng.randint(2, 4), len(words))
    start = rng.randint(0, len(words) - k)
    return " ".join(words[start:start + k])


def _mixed(rng: random.Random, lang: str, half: int | None) -> str:
    """A paragraph in ``lang`` with one sentence of another language inside; ``lang`` holds at least
    two thirds of the characters."""
    other = sentence(rng, rng.choice([x for x in LANGUAGES if x != lang]), half)
    own = [sentence(rng, lang, half), sentence(rng, lang, half)]
    while sum(map(len, own)) < 2 * len(other):
        own.append(sentence(rng, lang, half))
    own.insert(rng.randint(1, len(own)), other)
    return ("" if lang in _NO_SPACES else " ").join(own)


def _with_code(rng: random.Random, lang: str, half: int | None) -> str:
    """One or two sentences in ``lang``, the language's "for example:" and one or two code snippets."""
    code = "\n".join(rng.sample(CODE_SNIPPETS, rng.randint(1, 2)))
    return f"{paragraph(rng, lang, rng.randint(1, 2), half)} {_CODE_INTRO[lang]}\n{code}"


def langid_challenge(n_per_lang: int, seed: int = 0, half: int | None = 1) -> tuple[list[str], list[str], list[str]]:
    """Harder texts for language identification: ``(texts, labels, categories)``.

    ``n_per_lang`` texts per language of :data:`LANGUAGES` in each of :data:`LANGID_CATEGORIES`:
    ``paragraph`` (one to four clean sentences, as :func:`sample_texts`), ``short`` (two to four
    words, or three to six Chinese characters), ``mixed`` (one sentence of another language among
    at least twice as many characters of the labelled one) and ``code`` (a sentence or two
    introducing one or two code snippets, which are mostly English keywords and symbols). The
    sentences come from phrase half ``half`` (:func:`sentence`): by default the half that
    ``sample_texts(..., half=0)`` never uses.
    """
    rng = random.Random(f"lmfs-langid-challenge:{seed}")
    make = {"paragraph": lambda lang: paragraph(rng, lang, rng.randint(1, 4), half),
            "short": lambda lang: _snippet(rng, lang, half), "mixed": lambda lang: _mixed(rng, lang, half),
            "code": lambda lang: _with_code(rng, lang, half)}
    rows = [(make[cat](lang), lang, cat) for cat in LANGID_CATEGORIES for lang in LANGUAGES for _ in range(n_per_lang)]
    return [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]


@dataclass
class SamplePage:
    url: str
    html: bytes
    kind: str                    # what the page is (see the module docstring)
    lang: str = "en"
    main_text: str = ""          # the page's real content, what a perfect extractor returns
    content_type: str = "text/html; charset=utf-8"


_MENU = ["Home", "News", "Events", "Services", "About us", "Contact"]
_TITLES = {"en": "Town notes", "de": "Stadtnotizen", "fr": "Notes de la ville", "es": "Notas de la ciudad",
           "it": "Note della città", "nl": "Stadsnotities", "ru": "Городские заметки"}


def _page(title: str, paragraphs: list[str], lang: str = "en", charset: str = "utf-8", extra: str = "") -> str:
    """A complete page: the site's boilerplate around an <article> holding ``paragraphs``."""
    menu = "".join(f'<li><a href="/{m.lower().replace(" ", "-")}">{m}</a></li>' for m in _MENU)
    body = "".join(f"<p>{html.escape(p, quote=False)}</p>\n" for p in paragraphs)
    title = html.escape(title, quote=False)
    return (f'<!DOCTYPE html>\n<html lang="{lang}"><head><meta charset="{charset}"><title>{title}</title>\n'
            '<style>body { font-family: sans-serif; } nav li { display: inline; }</style>\n'
            '<script>window.dataLayer = window.dataLayer || []; function track(e) { dataLayer.push(e); }</script>\n'
            f'</head><body>\n<header><div class="logo">{_TITLES[lang]}</div><nav><ul>{menu}</ul></nav></header>\n'
            '<div class="cookies">This site uses cookies to improve your experience. Accept</div>\n'
            f'<main><article><h1>{title}</h1>\n{body}{extra}</article></main>\n'
            '<aside><h3>Popular</h3><ul><li><a href="/a">Ten tips</a></li>'
            '<li><a href="/b">Photos</a></li></ul></aside>\n'
            '<noscript>Please enable JavaScript to see the comments.</noscript>\n'
            '<footer><p>Copyright 2026 Town notes. All rights reserved.</p>'
            '<p><a href="/privacy">Privacy policy</a> | <a href="/terms">Terms of use</a></p></footer>\n'
            "</body></html>\n")


def _people(rng: random.Random) -> tuple[str, str, str, str]:
    name = rng.choice(["anna.berg", "tom.li", "info", "press", "m.garcia", "support"])
    email = f"{name}@{rng.choice(['example.org', 'example.com', 'mail.example.net'])}"
    phone = rng.choice([f"(555) {rng.randint(200, 999)}-{rng.randint(1000, 9999)}",
                        f"555-{rng.randint(200, 999)}-{rng.randint(1000, 9999)}",
                        f"+1 555 {rng.randint(200, 999)} {rng.randint(1000, 9999)}"])
    ipv4 = f"192.0.2.{rng.randint(1, 254)}"
    ipv6 = f"2001:db8:{rng.randint(1, 0xffff):x}::{rng.randint(1, 0xffff):x}"
    return email, phone, ipv4, ipv6


def generate_site(n_pages: int, seed: int = 0) -> list[SamplePage]:
    """``n_pages`` pages of a made-up town's web site plus its share of junk, deterministic for ``seed``.

    About half are English articles (some with PII), a sixth foreign-language ones, a tenth
    duplicates or near-duplicates, the rest low-quality or broken pages.
    """
    rng = random.Random(seed)
    pages: list[SamplePage] = []
    articles: list[SamplePage] = []
    kinds = (["article"] * 40 + ["pii"] * 8 + ["foreign"] * 16 + ["duplicate"] * 5 + ["near-duplicate"] * 5
             + ["spam", "short", "symbols", "bullets", "code", "lorem"] * 3
             + ["non-html", "empty", "latin-1", "undecodable"] * 2)
    for i in range(n_pages):
        kind = rng.choice(kinds)
        if kind in ("duplicate", "near-duplicate") and not articles:
            kind = "article"
        url = f"http://town.example.org/{kind}/{i}.html"
        title = sentence(rng, "en").rstrip(".")[:60]
        if kind in ("article", "pii"):
            paragraphs = english_paragraphs(rng, rng.randint(3, 7))
            if kind == "pii":
                email, phone, ipv4, ipv6 = _people(rng)
                paragraphs.insert(rng.randint(1, len(paragraphs)),
                                  f"For questions, write to {email} or call {phone} on weekdays. "
                                  f"The booking server at {ipv4} moved to {ipv6} last week.")
            page = SamplePage(url, _page(title, paragraphs).encode(), kind, main_text="\n".join([title] + paragraphs))
            articles.append(page)
        elif kind == "foreign":
            lang = rng.choice(SITE_FOREIGN)
            title = sentence(rng, lang).rstrip(".")[:60]
            paragraphs = [paragraph(rng, lang) for _ in range(rng.randint(3, 6))]
            page = SamplePage(url, _page(title, paragraphs, lang).encode(), kind, lang,
                              "\n".join([title] + paragraphs))
        elif kind == "duplicate":
            source = rng.choice(articles)
            page = SamplePage(url, source.html, kind, main_text=source.main_text)
        elif kind == "near-duplicate":
            source = rng.choice(articles)
            words = source.main_text.split(" ")
            for _ in range(max(1, len(words) // 50)):  # about 2% of the words changed
                words[rng.randrange(len(words))] = rng.choice(PHRASES["en"]["obj"]).split()[-1]
            main = " ".join(words)
            lines = main.split("\n")
            page = SamplePage(url, _page(lines[0], lines[1:]).encode(), kind, main_text=main)
        elif kind == "spam":
            words = ["cheap", "watches", "best", "price", "buy", "now", "free", "shipping", "discount"]
            spam = " ".join(rng.choice(words[:4]) if rng.random() < 0.7 else rng.choice(words) for _ in range(150))
            page = SamplePage(url, _page("Best price cheap watches", [spam, spam]).encode(), kind, main_text=spam)
        elif kind == "short":
            text = sentence(rng, "en")
            page = SamplePage(url, _page(title, [text]).encode(), kind, main_text=text)
        elif kind == "symbols":
            tags = " ".join(f"#{rng.choice(PHRASES['en']['obj']).split()[-1]}" for _ in range(60))
            lines = [sentence(rng, "en")[:-1] + "..." for _ in range(8)]
            page = SamplePage(url, _page(title, lines + [tags]).encode(), kind, main_text="\n".join(lines + [tags]))
        elif kind == "bullets":
            items = [rng.choice(PHRASES["en"]["obj"]) for _ in range(30)]
            extra = "<ul>" + "".join(f"<li>{x}</li>" for x in items) + "</ul>"
            page = SamplePage(url, _page(title, [], extra=extra).encode(), kind, main_text="\n".join(items))
        elif kind == "code":
            code = "for (let i = 0; i < n; i++) { total += price[i]; }"
            paragraphs = english_paragraphs(rng, 3)
            line = f"To sum the prices, the page runs the loop {code} in your browser."
            extra = ("<p>To sum the prices, the page runs the loop "
                     f"<code>{html.escape(code)}</code> "
                     "in your browser.</p>")
            page = SamplePage(url, _page(title, paragraphs, extra=extra).encode(), kind,
                              main_text="\n".join([title] + paragraphs + [line]))
        elif kind == "lorem":
            filler = ("Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor "
                      "incididunt ut labore et dolore magna aliqua. ") * 3
            paragraphs = english_paragraphs(rng, 2) + [filler]
            page = SamplePage(url, _page(title, paragraphs).encode(), kind, main_text="\n".join([title] + paragraphs))
        elif kind == "non-html":
            png = b"\x89PNG\r\n\x1a\n" + bytes(rng.randrange(256) for _ in range(200))
            page = SamplePage(url.replace(".html", ".png"), png, kind, content_type="image/png")
        elif kind == "empty":
            page = SamplePage(url, b"<html><head><title></title></head><body><div></div></body></html>", kind)
        elif kind == "latin-1":
            paragraphs = ["The sign of the café du marché says: ouvert à sept heures."] + english_paragraphs(rng, 3)
            # Characters Latin-1 lacks (curly quotes) become character references, as editors write them.
            body = _page(title, paragraphs, charset="iso-8859-1").encode("latin-1", errors="xmlcharrefreplace")
            page = SamplePage(url, body, kind, main_text="\n".join([title] + paragraphs), content_type="text/html")
        else:  # undecodable: declared UTF-8, but random bytes, as a mislabelled binary file would be
            junk = bytes(rng.randrange(128, 256) for _ in range(3000))
            page = SamplePage(url, b"<html><body><p>" + junk + b"</p></body></html>", kind)
        pages.append(page)
    return pages
