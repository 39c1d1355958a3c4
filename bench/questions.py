"""Fifty short chat questions (capitals, arithmetic, definitions) for first-token agreement with float."""

QUESTIONS: tuple[str, ...] = (
    "What is the capital of France?", "What is the capital of Japan?", "What is the capital of Italy?",
    "What is the capital of Germany?", "What is the capital of Spain?", "What is the capital of Canada?",
    "What is the capital of Australia?", "What is the capital of Egypt?", "What is the capital of Brazil?",
    "What is the capital of Kenya?", "What is the capital of Norway?", "What is the capital of Peru?",
    "What is the capital of India?", "What is the capital of Mexico?", "What is the capital of Greece?",
    "What is the capital of Portugal?", "What is the capital of Russia?",
    "What is 2 plus 2?", "What is 7 times 8?", "What is 10 minus 3?", "What is 12 divided by 4?",
    "What is 5 times 6?", "What is 100 plus 250?", "What is 9 squared?", "What is the square root of 81?",
    "What is 15 plus 27?", "How many days are in a week?", "How many minutes are in an hour?",
    "How many legs does a spider have?", "What is half of 50?", "What is 3 times 7?",
    "What is 1000 minus 1?", "How many sides does a triangle have?",
    "What is photosynthesis?", "Define gravity in one sentence.", "What is an atom?", "What is democracy?",
    "What is a noun?", "What is the boiling point of water?", "What is DNA?", "What is a volcano?",
    "What does a thermometer measure?", "What is an ecosystem?", "What is inflation in economics?",
    "What is a prime number?", "What is the largest planet in the solar system?",
    "Who wrote Romeo and Juliet?", "What language is spoken in Brazil?", "What is the chemical symbol for gold?",
    "What is the speed of light?",
)
