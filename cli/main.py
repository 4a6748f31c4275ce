def main():
    print("dilu")
