"""Print one table of every benchmark JSON in a folder (the end of a GPU round)."""
import json
import pathlib
import sys


def rows(doc, source):
    results = doc.get("results", {})
    items = results.items() if isinstance(results, dict) else ((r.get("name", "?"), r) for r in results)
    for name, entry in items:
        if isinstance(entry, dict):
            numbers = {k: v for k, v in entry.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            shown = ", ".join(f"{k}={v:.4g}" for k, v in list(numbers.items())[:6])
            yield source, str(name), shown


def main(folder):
    found = sorted(pathlib.Path(folder).glob("*.json"))
    if not found:
        print("no benchmark JSON in this round's output folder")
        return
    print(f"\n{'file':<34} {'system / case':<30} numbers")
    for path in found:
        try:
            doc = json.loads(path.read_text())
        except ValueError as exc:
            print(f"{path.name:<34} unreadable: {exc}")
            continue
        print(f"{path.name:<34} gpu={doc.get('gpu', '?')} commit={str(doc.get('commit', '?'))[:10]} date={doc.get('date', '?')}")
        for source, name, shown in rows(doc, path.name):
            print(f"{'':<34} {name:<30} {shown}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results")
