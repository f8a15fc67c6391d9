from sparkinfer_cli.cli import app

app()
