from llmpress.cli import run

run()
