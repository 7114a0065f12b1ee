def main():
    raise SystemExit("not built yet")
