"""The JSON extraction workload (`hf-specdec bench --workloads json`): a passage and a JSON schema per request,
written for this project; the fields are copied from the passage, so n-gram lookup finds them and the schema's
keys and punctuation are tokens the grammar forces."""

from __future__ import annotations

import json

_INSTRUCTION = ("Extract the information from the text below as a JSON object that follows the JSON schema. Copy "
                "values exactly as they appear in the text. Reply with the JSON object only.")


def _schema(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": required or list(properties),
            "additionalProperties": False}


_STR, _INT, _NUM = {"type": "string"}, {"type": "integer"}, {"type": "number"}

ITEMS = [
    ("Maria Okafor, 34, works as a marine biologist at the Westcove Research Station and lives in Port Ellery. "
     "She can be reached at maria.okafor@westcove.example.",
     _schema({"name": _STR, "age": _INT, "occupation": _STR, "employer": _STR, "city": _STR, "email": _STR})),
    ("The Lumen K2 desk lamp costs 49.99 euros, weighs 1.2 kilograms and comes in graphite grey. It ships from the "
     "Rotterdam warehouse within 3 working days.",
     _schema({"product": _STR, "price": _NUM, "currency": _STR, "weight_kg": _NUM, "colour": _STR,
              "warehouse": _STR, "shipping_days": _INT})),
    ("The Northfield Jazz Festival opens on 14 June 2027 at Riverside Park and runs for three days. Tickets start "
     "at 25 pounds, and the headline act is the Delia Marsh Quartet.",
     _schema({"event": _STR, "start_date": _STR, "venue": _STR, "duration_days": _INT, "ticket_price": _NUM,
              "headliner": _STR})),
    ("Invoice INV-20931 was issued by Brightline Plumbing Ltd to Harlow Dental Clinic on 2 March 2027. The total "
     "due is 1840.50 dollars, payable within 30 days to account 44-1029-7781.",
     _schema({"invoice_number": _STR, "supplier": _STR, "customer": _STR, "issue_date": _STR, "total": _NUM,
              "payment_terms_days": _INT, "account": _STR})),
    ("Kestrel Analytics is hiring a senior data engineer in Lisbon. The role is full time, pays between 62000 and "
     "75000 euros a year, and asks for five years of experience with Python and SQL.",
     _schema({"company": _STR, "title": _STR, "location": _STR, "employment_type": _STR, "salary_min": _INT,
              "salary_max": _INT, "years_experience": _INT,
              "skills": {"type": "array", "items": _STR}})),
    ("Weather for Glenmoor on Tuesday: light rain in the morning, clearing by the afternoon, a high of 17 degrees "
     "and a low of 9 degrees, with winds from the south-west at 22 kilometres per hour.",
     _schema({"town": _STR, "day": _STR, "morning": _STR, "afternoon": _STR, "high_c": _INT, "low_c": _INT,
              "wind_direction": _STR, "wind_kmh": _INT})),
    ("The Salt Road, a novel by Imogen Varga, was published by Halcyon Books in 2019. It has 312 pages, is set in "
     "nineteenth-century Morocco, and won the Ashworth Prize for historical fiction.",
     _schema({"title": _STR, "author": _STR, "publisher": _STR, "year": _INT, "pages": _INT, "setting": _STR,
              "award": _STR})),
    ("Flight SK 1427 from Oslo to Reykjavik departs at 08:45 from gate B12 and arrives at 09:55 local time. The "
     "aircraft is an Airbus A320neo and the booking reference is QX7P2L.",
     _schema({"flight": _STR, "origin": _STR, "destination": _STR, "departure": _STR, "gate": _STR,
              "arrival": _STR, "aircraft": _STR, "booking_reference": _STR})),
]


def extraction_prompt(passage: str, schema: dict) -> str:
    return f"{_INSTRUCTION}\n\nText: {passage}\n\nJSON schema: {json.dumps(schema)}"


PROMPTS = [extraction_prompt(passage, schema) for passage, schema in ITEMS]
SCHEMAS = [schema for _, schema in ITEMS]
